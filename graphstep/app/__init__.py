"""The app on top of the engine (CLI, demo, built-in model, benchmark); the core never imports it."""
