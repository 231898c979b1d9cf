"""``longqa bench``: speed of the training layouts and of sampling on random-weight models of real shapes
(``speed``), and peak memory measured against the planner's count (``memory``)."""
