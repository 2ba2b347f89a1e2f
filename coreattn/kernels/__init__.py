"""Raw Triton kernels and their launchers (no autograd)."""

from coreattn.kernels.attn_bwd import varlen_attn_bwd
from coreattn.kernels.attn_fwd import _varlen_attn_fwd_kernel, varlen_attn_fwd


def runs_in_interpreter() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_varlen_attn_fwd_kernel, InterpretedFunction)


__all__ = ["varlen_attn_fwd", "varlen_attn_bwd", "runs_in_interpreter"]
