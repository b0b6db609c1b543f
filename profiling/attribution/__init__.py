"""``Attribution`` = the survey + the matching + the partition + the idle causes: the breakdown of every step
on every rank, and ``scale``, the same computed per rank on executors."""
