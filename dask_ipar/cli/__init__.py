"""The ``dask-ipar`` command: ``train``, ``check``, ``calibrate`` (:mod:`.main`), ``plan``
(:mod:`.plan`) and ``config`` (:mod:`.config`).
"""

__all__: list[str] = []
