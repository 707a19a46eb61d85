"""The step itself: the stages (stages/), the step context and domains they build from, the loss scaler, the
folded sums of squares, QK-clip's math and torch GradScaler's hand-over. Device work only: no stage syncs
with the host or talks to peers outside its collectives."""
