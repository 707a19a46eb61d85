"""graphstep (being assembled)."""
