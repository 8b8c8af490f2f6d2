"""Argument handling the DeepSpeed-named optimizers share."""


class SetGradNone:
    """DeepSpeed's fused optimizers take `set_grad_none`: what zero_grad() does by default."""

    set_grad_none = True

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
