"""What graphstep installs on the user's model: the one post-accumulate-grad hook per param and its ordered
listeners (main grads, grads-seen flag, norm fold, overlapped reduce-scatter), the model's state-dict hooks,
the DDP watch and ``no_sync``. All held weakly: a dropped optimizer leaves nothing running."""
