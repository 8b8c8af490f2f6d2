"""Argument checks the DeepSpeed-named optimizers share."""


def fp32_states_only(cls: str, fp32_optimizer_states: bool) -> None:
    if not fp32_optimizer_states:
        raise ValueError(f"{cls}: fp32_optimizer_states=False (moments in the parameter dtype) is not supported; "
                         "optimizer states are fp32 here")


class SetGradNone:
    """DeepSpeed's fused optimizers take `set_grad_none`: what zero_grad() does by default."""

    set_grad_none = True

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
