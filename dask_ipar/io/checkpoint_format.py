"""The checkpoint format: metadata schema, its validation and the checksums (no I/O, no dask).

A checkpoint's group metadata (the attributes of its ``zarr.json``) is a JSON object::

    format        "dask-ipar-checkpoint"
    version       2 (1: written before checksums; read, but nothing can be verified;
                  3: with Adam's moments, unreadable by releases before them)
    step          training steps done (equal to the <step> of the ckpt-<step> directory)
    grid          [pr, pc] of the saving grid
    dtype         "float32" or "float64"
    sizes         layer widths [d_0, ..., d_L]
    layers        [{name, n_in, n_out, bias, activation}, ...], one per weight matrix
    has_velocity  whether every layer's optimizer state is stored: the momentum ``<name>/v``,
                  or with ``optimizer_state: "adam"`` Adam's moments ``<name>/m`` and ``<name>/s``
    optimizer_state  (optional) "momentum" (the default) or "adam"
    optimizer_steps  (optional) updates that made the state (Adam's bias correction)
    input_shape   (CNNs) [C, H, W]
    created       ISO time of the save
    extra         the caller's JSON metadata
    arrays        (version 2) {"dense0/w": {"shape", "chunks", "sha256": {"i.j": hex}}, ...}
    checksum      (version 2) "sha256:<hex>" of all the attributes above, canonical JSON

Each chunk's SHA-256 is taken over its values (little-endian, C order, the edge chunks
cut to the array) by the worker that writes it; a worker that reads a block checks
every chunk it decodes. The metadata checksum ties the step, sizes, optimizer state
present and array checksums together: an edited or truncated ``zarr.json`` is refused.
This guards against accidents (damaged files, edits, copies of another run's arrays),
not against someone who rewrites the checksums on purpose.
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np

from dask_ipar.errors import IparError

__all__ = [
    "FORMAT",
    "VERSION",
    "ADAM_VERSION",
    "READABLE_VERSIONS",
    "CheckpointCorrupt",
    "CheckpointStorageError",
    "chunk_digest",
    "chunk_id",
    "meta_digest",
    "expected_arrays",
    "validate_metadata",
]

FORMAT = "dask-ipar-checkpoint"
VERSION = 2
#: written for checkpoints of Adam's state (``optimizer_state: adam``), which older
#: releases cannot read
ADAM_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_LAYER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DTYPES = ("float32", "float64")


class CheckpointCorrupt(IparError):
    """A checkpoint that cannot be trusted: unreadable, incomplete, edited or damaged.

    ``--resume`` (``load(..., fallback=True)``) skips such a checkpoint and loads the
    newest older one that verifies.
    """


class CheckpointStorageError(IparError):
    """The checkpoint directory cannot be written (disk full, read-only, permission)."""


def chunk_digest(values) -> str:
    """SHA-256 (hex) of a chunk's values: little-endian, C order."""
    a = np.asarray(values)
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


def chunk_id(ci: int, cj: int) -> str:
    """Name of chunk ``(ci, cj)`` in the metadata (as in its file path ``c/ci/cj``)."""
    return f"{ci}.{cj}"


def _canonical(attrs: dict) -> bytes:
    body = {k: v for k, v in attrs.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=True).encode("ascii")


def meta_digest(attrs: dict) -> str:
    """The ``checksum`` of a metadata dict: SHA-256 of every other attribute."""
    return "sha256:" + hashlib.sha256(_canonical(attrs)).hexdigest()


def expected_arrays(meta: dict) -> dict[str, tuple[int, int]]:
    """``{"<layer>/w": shape, "<layer>/v": shape, ...}`` that the metadata promises."""
    out = {}
    for lay in meta["layers"]:
        shape = (lay["n_out"], lay["n_in"] + int(lay["bias"]))
        out[f"{lay['name']}/w"] = shape
        if meta["has_velocity"]:
            kinds = ("m", "s") if meta.get("optimizer_state") == "adam" else ("v",)
            for kind in kinds:
                out[f"{lay['name']}/{kind}"] = shape
    return out


def _is_int(v, lo=0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def validate_metadata(attrs, where: str, dir_step: int | None = None) -> dict:
    """Check a checkpoint's metadata; return it, or raise :class:`CheckpointCorrupt`.

    ``where`` names the checkpoint in messages; ``dir_step`` is the ``<step>`` of its
    ``ckpt-<step>`` directory name (None when the directory is named otherwise).
    Raises IparError (not corrupt, just foreign) for another format or a newer version.
    """
    def bad(what):
        raise CheckpointCorrupt(f"checkpoint {where}: {what}; it is corrupted or was edited.")

    if not isinstance(attrs, dict):
        bad("the metadata is not a JSON object")
    # a checksum that fails means damage, whatever the fields say (format and version too)
    if "checksum" in attrs and (not isinstance(attrs["checksum"], str)
                                or meta_digest(attrs) != attrs["checksum"]):
        bad("the metadata does not match its checksum")
    if attrs.get("format") != FORMAT:
        raise IparError(
            f"{where} is a Zarr group but not a dask-ipar checkpoint (format "
            f"{attrs.get('format')!r}, expected {FORMAT!r})."
        )
    version = attrs.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise IparError(
            f"checkpoint {where} has format version {version!r}; this dask-ipar reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}. Use the dask-ipar release "
            "that wrote it."
        )
    if version >= 2 and not isinstance(attrs.get("checksum"), str):
        bad("the metadata has no checksum")
    need = ("step", "grid", "dtype", "sizes", "layers", "has_velocity")
    missing = [k for k in need if k not in attrs]
    if missing:
        bad(f"the metadata lacks {', '.join(missing)}")
    step = attrs["step"]
    if not _is_int(step):
        bad(f"step is {step!r}, expected an integer >= 0")
    if dir_step is not None and step != dir_step:
        bad(f"the metadata says step {step} but the directory is ckpt-{dir_step}")
    grid = attrs["grid"]
    if not (isinstance(grid, list) and len(grid) == 2 and all(_is_int(v, 1) for v in grid)):
        bad(f"grid is {grid!r}, expected [pr, pc] of positive integers")
    if attrs["dtype"] not in _DTYPES:
        bad(f"dtype is {attrs['dtype']!r}, expected one of {', '.join(_DTYPES)}")
    if not isinstance(attrs["has_velocity"], bool):
        bad(f"has_velocity is {attrs['has_velocity']!r}, expected true or false")
    if attrs.get("optimizer_state", "momentum") not in ("momentum", "adam"):
        bad(f"optimizer_state is {attrs['optimizer_state']!r}, expected momentum or adam")
    if not _is_int(attrs.get("optimizer_steps", 0)):
        bad(f"optimizer_steps is {attrs['optimizer_steps']!r}, expected an integer >= 0")
    sizes = attrs["sizes"]
    if not (isinstance(sizes, list) and sizes and all(v is None or _is_int(v, 1) for v in sizes)):
        bad(f"sizes is {sizes!r}, expected a list of layer widths")
    layers = attrs["layers"]
    if not isinstance(layers, list) or not layers:
        bad("layers is not a non-empty list")
    names = set()
    for k, lay in enumerate(layers):
        if not isinstance(lay, dict):
            bad(f"layer {k} is not an object")
        for field, ok, expect in (
            ("name", lambda v: isinstance(v, str) and _LAYER_NAME.match(v), "a layer name"),
            ("n_in", lambda v: _is_int(v, 1), "a positive integer"),
            ("n_out", lambda v: _is_int(v, 1), "a positive integer"),
            ("bias", lambda v: isinstance(v, bool), "true or false"),
            ("activation", lambda v: isinstance(v, str), "an activation name"),
        ):
            if field not in lay:
                bad(f"layer {k} has no {field}")
            if not ok(lay[field]):
                bad(f"layer {k} has {field} = {lay[field]!r}, expected {expect}")
        if lay["name"] in names:
            bad(f"layer name {lay['name']!r} appears twice")
        names.add(lay["name"])
    if version >= 2:
        arrays = attrs.get("arrays")
        if not isinstance(arrays, dict):
            bad("the metadata has no array checksums")
        want = expected_arrays(attrs)
        if set(arrays) != set(want):
            extra = sorted(set(arrays) ^ set(want))
            bad(f"the arrays listed ({', '.join(sorted(arrays))}) are not those the layers and "
                f"has_velocity = {str(attrs['has_velocity']).lower()} call for "
                f"(differ in {', '.join(extra)})")
        for name, shape in want.items():
            rec = arrays[name]
            if not isinstance(rec, dict):
                bad(f"array {name} has no record")
            if rec.get("shape") != list(shape):
                bad(f"array {name} is recorded with shape {rec.get('shape')!r}, the layers "
                    f"say {list(shape)}")
            chunks = rec.get("chunks")
            if not (isinstance(chunks, list) and len(chunks) == 2
                    and all(_is_int(v, 1) for v in chunks)):
                bad(f"array {name} has chunks {chunks!r}")
            digests = rec.get("sha256")
            n = [-(-s // c) for s, c in zip(shape, chunks)]
            ids = {chunk_id(a, b) for a in range(n[0]) for b in range(n[1])}
            if not isinstance(digests, dict) or set(digests) != ids:
                bad(f"array {name} lacks checksums for some of its {len(ids)} chunks")
    return attrs
