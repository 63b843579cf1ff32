"""The finishing touches the kernel scripts in tools/ give a plot over sequence length: a log2 token axis, labels,
a title and a legend."""

from __future__ import annotations


def finish_token_axes(fig, ax, *, ylabel: str, title: str, legend_size: int = 8):
    """Log2 x axis labelled "tokens", ``ylabel``, ``title``, a legend of ``legend_size`` points; returns ``fig``
    laid out tight."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    return fig
