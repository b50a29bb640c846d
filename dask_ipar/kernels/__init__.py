"""The per-block kernels the step graph runs, array-module generic (NumPy, CuPy, any array
API namespace): dense layers and updates (:mod:`.dense`), the loss (:mod:`.loss`),
convolution and pooling (:mod:`.conv`).
"""

__all__: list[str] = []
