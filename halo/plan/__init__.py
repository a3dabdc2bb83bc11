"""Planning: where every row of a field lives and what each layer needs of its neighbours.

=================  ===============================================================================================
``partition``      the balanced split of a global extent over ranks, and which rank holds which source row
``geometry``       each layer's rows: input rows an output row reads (conv, pool, pad, shuffle, window, adaptive)
``agree``          one cross-rank agreement of a call's metadata (shapes, dtypes, devices) before it communicates
``entry``          the global grid of a converted model's input, fixed where it becomes known
``replicated``     the check that every rank of a domain group holds the same parameters and buffers
``plans``          the per-rank cache of agreed plans, and the root a converted model's calls hang from
=================  ===============================================================================================
"""

from .partition import local_range, split_offsets, split_sizes
from .plans import set_limits, set_validation
from .replicated import check_replicated

__all__ = ["check_replicated", "local_range", "set_limits", "set_validation", "split_offsets", "split_sizes"]
