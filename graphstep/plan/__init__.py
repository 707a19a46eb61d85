"""Planning, done once when the optimizer is built: which params the model gives (model_params), which group
and family each falls in (overrides, routing), how they are laid out in flat buckets and shards (layout,
layerwise) and how the expert params form their own domain (experts). Nothing here runs in the step."""
