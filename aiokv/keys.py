"""Page keys: cumulative xxh3-128 over a namespace seed and the token ids of a prompt.

Key *i* covers tokens ``[0, (i + 1) * page_tokens)``: it is the xxh3-128 digest of the 16-byte
namespace seed, ``page_tokens`` as a little-endian uint64, then those token ids as little-endian
uint64. The seed mixes the layout
fingerprint, the model namespace and the per-request salt, so keys of different tenants, models or
layouts never coincide. Only full pages get keys.

The hashing is one streaming xxh3 state updated page by page (one C call per page, never a
Python loop over tokens).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from aiokv.layout import KVKind, KVLayout, TPSlice

PageKey = bytes
"""A page key: 16 bytes."""

KEY_BYTES = 16
MAX_TOKEN_ID = 2**63 - 1

Tokens = Sequence[int] | npt.NDArray[np.integer] | torch.Tensor
"""Token ids: a list of ints, a 1-D integer numpy array or a 1-D integer torch tensor (any device)."""

Salt = str | bytes | None
"""Per-request salt that isolates tenants; ``None`` is the shared namespace."""


_TORCH_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                             torch.uint16, torch.uint32, torch.uint64})
"""Tensor dtypes token ids may have."""

SALT_TYPES = (str, bytes, type(None))
"""What a salt may be (checked at the public edge before the salt is looked up in a cache of seeds)."""


def check_salt(salt: object) -> None:
    """Raise ``TypeError`` unless ``salt`` is a str, bytes or None (a cheap type check: a salt's
    text is encoded, and a lone surrogate refused, only when its seed is made)."""
    if not isinstance(salt, SALT_TYPES):
        raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")


def encoded(text: str, what: str) -> bytes:
    """``text`` as UTF-8; ``ValueError`` naming ``what`` for text that has none (a lone surrogate)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} must be encodable as UTF-8 ({exc.reason} at index {exc.start})") from None


def namespace_seed(layout: KVLayout, namespace: str, salt: Salt = None, part: bytes = b"") -> bytes:
    """16-byte seed from the layout fingerprint, the model namespace, the salt and the page part.

    ``part`` names which rows of each page the keyed pages hold when they hold only some (a
    tensor-parallel rank's head slice, see :func:`tp_part`); empty for whole pages. Raises
    ``TypeError`` when ``namespace`` is not a str or ``salt`` is not str/bytes/None.
    """
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    if salt is None:
        salt_bytes, salt_tag = b"", b"n"
    elif isinstance(salt, str):
        salt_bytes, salt_tag = encoded(salt, "salt"), b"s"
    elif isinstance(salt, (bytes, bytearray)):
        salt_bytes, salt_tag = bytes(salt), b"b"
    else:
        raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")
    ns = encoded(namespace, "namespace")
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    material = b"".join(
        (
            b"aiokv-seed-v1",
            layout.fingerprint,
            len(ns).to_bytes(8, "little"),
            ns,
            salt_tag,
            len(salt_bytes).to_bytes(8, "little"),
            salt_bytes,
            len(part).to_bytes(8, "little") if part else b"",
            part,
        )
    )
    return xxhash.xxh3_128_digest(material)


def tp_part(tp: TPSlice, layout: KVLayout) -> bytes:
    """The key material of a rank's slice when its pages hold only its rows, else ``b""``.

    Pages written by one rank of a tensor-parallel group hold that rank's heads only: their keys
    must differ from other slices' keys so that no rank ever reads another rank's rows as its own.
    Replicas of one head (tp_size > kv heads) share the slice, hence the pages.
    """
    if layout.kind is KVKind.MLA or tp.local_heads == layout.num_kv_heads:
        return b""
    return f"tp-heads={tp.head_start}+{tp.local_heads}/{layout.num_kv_heads}".encode("ascii")


def token_array(tokens: Tokens) -> npt.NDArray[np.uint64]:
    """Validate ``tokens`` and return them as a 1-D little-endian uint64 array.

    Raises ``TypeError`` for floats, booleans, non-integers or a wrong container, and
    ``ValueError`` for negative ids, ids >= 2**63, or more than one dimension.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.is_nested or tokens.layout is not torch.strided:
            # (a sparse tensor's numpy() raised torch's TypeError, a nested one's shape a RuntimeError)
            raise TypeError(f"token ids must be a dense (strided) tensor, got layout {tokens.layout}"
                            f"{' (nested)' if tokens.is_nested else ''}")
        if tokens.dtype not in _TORCH_INTEGERS:  # quantized dtypes are neither float nor complex
            raise TypeError(f"token ids must be integers, got a tensor of {tokens.dtype}")
        if tokens.dim() != 1:
            raise ValueError(f"token ids must be 1-D, got a tensor of shape {tuple(tokens.shape)}")
        if tokens.device.type == "meta":
            raise ValueError("token ids are on the meta device: they hold no values")
        host = tokens.detach().to("cpu")
        # uint64 as it is: through int64, ids >= 2**63 wrapped round and were refused as negative.
        values: npt.NDArray[np.integer] = (host if host.dtype == torch.uint64 else host.to(torch.int64)).numpy()
    elif isinstance(tokens, np.ndarray):
        masked = sys.modules.get("numpy.ma")  # not imported (a stall on a first call): none can exist
        if masked is not None and isinstance(tokens, masked.MaskedArray):
            # Its values under the mask are hashed as they are: the key would not be the prompt's.
            raise TypeError("token ids must not be a masked array: pass the ids of the prompt only")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a numpy array of {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got a numpy array of shape {tokens.shape}")
        values = tokens
    elif isinstance(tokens, (list, tuple)):
        if list(map(type, tokens)).count(int) == len(tokens):
            return _exact_ints(tokens)
        # Not all exactly int (numpy integers, or bad input): one C-level pass over the element
        # types, then numpy's conversion.
        kinds = set(map(type, tokens))
        if bool in kinds or not all(issubclass(kind, (int, np.integer)) for kind in kinds):
            bad = next(v for v in tokens if isinstance(v, bool) or not isinstance(v, (int, np.integer)))
            raise TypeError(f"token ids must be ints, found {type(bad).__name__} {bad!r}")
        try:
            values = np.asarray(tokens, dtype=np.int64) if tokens else np.empty(0, np.int64)
        except OverflowError:
            raise ValueError("token ids must be in [0, 2**63); found one outside") from None
    else:
        raise TypeError(
            f"token ids must be a list of ints, a 1-D integer numpy array or tensor; got {type(tokens).__name__}"
        )
    if values.size:
        if values.dtype.kind == "i" and int(values.min()) < 0:
            raise ValueError(f"token ids must be non-negative, found {int(values.min())}")
        if values.dtype == np.uint64 and int(values.max()) > MAX_TOKEN_ID:
            raise ValueError(f"token ids must be < 2**63, found {int(values.max())}")
    if values.dtype.itemsize == 8 and values.dtype.byteorder in "=<" and values.flags.c_contiguous:
        return values.view("<u8")  # non-negative int64 has the same bytes as uint64: no copy
    return np.ascontiguousarray(values, dtype="<u8")


def _exact_ints(tokens: Sequence[int]) -> npt.NDArray[np.uint64]:
    """:func:`token_array` of a list or tuple whose every element's type is exactly ``int``.

    ``array('Q', ...)`` converts in one C loop and refuses negative and >= 2**64 ids itself
    (``OverflowError``), where ``np.asarray`` went through numpy's generic sequence conversion: a
    4,096-token list took 320 µs of loop time with the type check, now about 120 µs.
    """
    try:
        words = array("Q", tokens)
    except OverflowError:
        low = min(tokens)
        if low < 0:
            raise ValueError(f"token ids must be non-negative, found {low}") from None
        raise ValueError("token ids must be < 2**63; found one outside") from None
    ids = np.frombuffer(words, dtype=np.uint64)
    if ids.size and int(ids.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token ids must be < 2**63, found {int(ids.max())}")
    return ids if sys.byteorder == "little" else ids.astype("<u8")


def page_keys(tokens: Tokens, page_tokens: int, seed: bytes, max_pages: int | None = None) -> list[PageKey]:
    """Keys of the full pages of ``tokens`` (a partial last page gets none).

    ``seed`` is from :func:`namespace_seed`; ``max_pages`` stops early. Raises as
    :func:`token_array` does, and ``ValueError`` for a non-positive ``page_tokens`` or a seed that
    is not 16 bytes.
    """
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens <= 0:
        raise ValueError(f"page_tokens must be a positive int, got {page_tokens!r}")
    if not isinstance(seed, bytes) or len(seed) != KEY_BYTES:
        raise ValueError("seed must be 16 bytes from namespace_seed()")
    ids = token_array(tokens)
    pages = ids.size // page_tokens
    if max_pages is not None:
        pages = min(pages, max(0, max_pages))
    if pages == 0:
        return []
    rows = ids[: pages * page_tokens].reshape(pages, page_tokens)
    # The page size enters the stream too, so keys of one seed under two page sizes never meet.
    state = xxhash.xxh3_128(seed + page_tokens.to_bytes(8, "little"))
    update, digest = state.update, state.digest
    keys: list[PageKey] = []
    append = keys.append
    for row in rows:
        update(row)  # type: ignore[arg-type]  # numpy stubs lack the buffer protocol
        append(digest())
    return keys
