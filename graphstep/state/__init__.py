"""What the optimizer holds between steps: the static flat buffers (params, grads, fp32 main params and the
families' states over the ranges they own), and the live hyperparameter table the step reads."""
