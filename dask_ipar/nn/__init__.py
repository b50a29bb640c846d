"""The network: layer values (:mod:`.layers`), the step graph and the dense layer's phases
(:mod:`.engine`), the domain-parallel conv front (:mod:`.domain`, :mod:`.front`) and the
bridge from layers to the cost model's specs (:mod:`.planning`).
"""

__all__: list[str] = []
