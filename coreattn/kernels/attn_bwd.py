def varlen_attn_bwd(*args, **kwargs):
    raise NotImplementedError("backward kernels not written yet")
