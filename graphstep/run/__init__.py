"""Running the step: capture, replay and recapture (runner), the stage-by-stage debug step (debug) and the
memory report (memory)."""
