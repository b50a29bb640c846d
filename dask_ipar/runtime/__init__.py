"""Running on a dask cluster: starting or joining it (:mod:`.cluster`), binding grid cells
to workers (:mod:`.workers`), the per-worker step programs (:mod:`.programs`), lineage
cuts (:mod:`.lineage`), the byte meter (:mod:`.meter`) and calibration
(:mod:`.calibrate`).
"""

__all__: list[str] = []
