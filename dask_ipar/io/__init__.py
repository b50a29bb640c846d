"""Data in and out: training data (:mod:`.data`), checkpoints (:mod:`.checkpoint`, format
in :mod:`.checkpoint_format`) and the run card (:mod:`.report`).
"""

__all__: list[str] = []
