"""Where things live on the ``Pr x Pc`` grid: the grid itself (:mod:`.grid`), balanced
splits of an axis (:mod:`.partition`) and the halo geometry of a strip (:mod:`.halo`).
Pure Python, no dask.
"""

__all__: list[str] = []
