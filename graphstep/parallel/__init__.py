"""Talking to other ranks: the process groups and named, time-bounded collectives (collectives), and how the
ranks agree on recapturing a stale step (agreement)."""
