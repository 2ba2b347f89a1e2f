"""Tuned launch configs: the files ``python -m coreattn.tune`` writes, and the lookup the launchers make.

A file holds the configs one GPU timed fastest on one software stack. It is keyed by the GPU's
name and compute capability and the Triton and coreattn versions (``DeviceKey``); a launch uses
its entries only when all four are this process's. Two places are read, and for each entry the
first wins:

1. the user cache, ``$COREATTN_TUNE_CACHE`` (a directory, or one file) or else
   ``$XDG_CACHE_HOME/coreattn/tune`` (``~/.cache/coreattn/tune``); in a directory, the file named
   for this device and these versions (``file_name``);
2. the files shipped in the package, ``coreattn/kernels/tuned/*.json``: contributed from users' runs,
   each for one GPU; those for other GPUs or versions are skipped without a word.

Entries are keyed by kernel ("fwd", "dkdv", "dq", "preprocess") and launch class (``KernelClass``:
head dims, dtype, mask, the features that change the kernel's code, GQA). A lookup takes the
class's entry, else the same class with the other GQA setting (GQA changes loop counts, not the
compiled kernel), else none: the shipped table. Files are read once per process (``reload`` reads
them again), so the configs of a training run never change under it; nothing here times or tunes.

Ignored, each with one warning naming the file: a file that does not parse or is not this format;
a user-cache file whose key is another GPU's or another Triton/coreattn version's (in a cache
directory: files this GPU left with older versions, which an upgrade makes stale); an entry with
a malformed config; an entry whose kernel fails to compile at launch (``reject``, called by the
launchers' ``tuned_fallback``, which then runs the shipped config).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from coreattn.kernels.configs.base import KERNELS, AttnConfig

ENV_CACHE = "COREATTN_TUNE_CACHE"
FORMAT = "coreattn-tuned-configs/1"
PACKAGE_DIR = Path(__file__).with_name("tuned")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# keep: [B, S] keep masks (padded layouts); bias: an additive bias computed in registers (TableBias)
FEATURES = ("dropout", "sink", "max_logit", "keep", "bias")
# the features that change each kernel's code; the others leave it as it is and are not in its class
KERNEL_FEATURES = {"fwd": FEATURES, "dkdv": ("dropout", "keep", "bias"), "dq": ("dropout", "sink", "keep", "bias"),
                   "preprocess": ()}
CONFIG_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "maxnreg", "warp_specialize", "tma")


class TunedConfigWarning(UserWarning):
    """A tuned-config file or entry that is not used (the launch takes the shipped table instead)."""


class KernelClass(NamedTuple):
    """What a launch is, as far as its best config may differ: id ``hdim192x128-bf16-causal-gqa-dropout``."""

    dim_qk: int
    dim_v: int
    dtype: str  # bf16 | fp16 | fp32
    causal: bool = False  # a causal or sliding-window band (the kernels' HAS_LEFT / HAS_RIGHT)
    gqa: bool = False  # more q heads than kv heads
    features: tuple[str, ...] = ()  # of FEATURES, in that order

    @property
    def id(self) -> str:
        parts = [f"hdim{self.dim_qk}x{self.dim_v}", self.dtype, "causal" if self.causal else "full"]
        return "-".join(parts + (["gqa"] if self.gqa else []) + list(self.features))

    @classmethod
    def parse(cls, text: str) -> KernelClass:
        match = re.fullmatch(r"hdim(\d+)x(\d+)-(bf16|fp16|fp32)-(causal|full)((?:-[a-z_]+)*)", text)
        if not match:
            raise ValueError(f"not a kernel class id: {text!r}")
        rest = [p for p in match.group(5).split("-") if p]
        gqa = bool(rest) and rest[0] == "gqa"
        features = tuple(rest[1:] if gqa else rest)
        if any(f not in FEATURES for f in features) or list(features) != sorted(features, key=FEATURES.index):
            raise ValueError(f"{text!r}: features must be some of {FEATURES}, in that order")
        return cls(int(match.group(1)), int(match.group(2)), match.group(3), match.group(4) == "causal", gqa, features)

    def for_kernel(self, kernel: str) -> KernelClass:
        """The class as ``kernel``'s code sees it: features that do not change it dropped; the
        preprocess kernel (rowsum(dO * O)) keeps only the head dims and dtype."""
        features = tuple(f for f in self.features if f in KERNEL_FEATURES[kernel])
        if kernel == "preprocess":
            return self._replace(causal=False, gqa=False, features=())
        return self._replace(features=features)


def launch_class(q: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int, *, heads_kv: int,
                 dropout: bool = False, sink: bool = False, max_logit: bool = False, keep: bool = False,
                 bias: bool = False) -> KernelClass:
    """The class of a launch on q [.., Hq, Dqk] and v [.., Hkv, Dv] (the launchers' view)."""
    flags = dict(dropout=dropout, sink=sink, max_logit=max_logit, keep=keep, bias=bias)
    return KernelClass(q.shape[-1], v.shape[-1], DTYPE_NAMES.get(q.dtype, str(q.dtype)),
                       window_left >= 0 or window_right >= 0, q.shape[-2] != heads_kv,
                       tuple(f for f in FEATURES if flags[f]))


class DeviceKey(NamedTuple):
    gpu: str  # torch.cuda.get_device_name
    capability: str  # "9.0"
    triton: str
    coreattn: str


def versions() -> tuple[str, str]:
    """(Triton's version, coreattn's version) of this process. coreattn's is read from the package
    this module belongs to, which Python imported before it (no upward import)."""
    import triton

    return triton.__version__, sys.modules[__name__.partition(".")[0]].__version__


@functools.lru_cache(maxsize=None)
def _device_key(index: int) -> DeviceKey:
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceKey(torch.cuda.get_device_name(index), f"{major}.{minor}", *versions())


def device_key(device: torch.device) -> DeviceKey:
    return _device_key(device.index if device.index is not None else torch.cuda.current_device())


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def file_name(key: DeviceKey) -> str:
    """The cache file of one device and software stack, e.g.
    ``nvidia-h100-80gb-hbm3_cc90_triton-3.9.0_coreattn-0.1.0.json``."""
    return f"{_device_prefix(key)}triton-{key.triton}_coreattn-{key.coreattn}.json"


def _device_prefix(key: DeviceKey) -> str:
    return f"{_slug(key.gpu)}_cc{key.capability.replace('.', '')}_"


def user_cache() -> Path:
    """``$COREATTN_TUNE_CACHE`` (a directory or a file), else the XDG cache directory's coreattn/tune."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "coreattn" / "tune"


def user_cache_file(key: DeviceKey) -> Path:
    """Where the tuner writes, and the launchers read, this device's configs."""
    cache = user_cache()
    return cache if cache.suffix == ".json" else cache / file_name(key)


# ---- reading and writing files

class Entry(NamedTuple):
    config: AttnConfig
    path: Path


class TunedFile(NamedTuple):
    key: DeviceKey
    entries: dict  # (kernel, class id) -> AttnConfig
    raw: dict  # the whole JSON object (the tuner's record: times, speedups, its arguments)


def config_to_json(cfg: AttnConfig) -> dict:
    return {name: getattr(cfg, name) for name in CONFIG_FIELDS}


def config_from_json(obj) -> AttnConfig:
    """A config from its JSON object; ValueError when malformed."""
    required = {"block_m", "block_n", "num_warps"}
    if not isinstance(obj, dict) or set(obj) - set(CONFIG_FIELDS) or not required <= set(obj):
        raise ValueError(f"a config has the fields {CONFIG_FIELDS}, got {obj!r}")
    fields = {name: obj[name] for name in CONFIG_FIELDS if name in obj}
    cfg = AttnConfig(**dict(fields, num_stages=obj.get("num_stages")))
    pow2 = lambda n, lo: isinstance(n, int) and not isinstance(n, bool) and n >= lo and n & (n - 1) == 0  # noqa: E731
    if not (pow2(cfg.block_m, 16) and (cfg.block_n == 0 or pow2(cfg.block_n, 16)) and pow2(cfg.num_warps, 1)
            and (cfg.num_stages is None or (isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 8))
            and (cfg.maxnreg is None or (isinstance(cfg.maxnreg, int) and 24 <= cfg.maxnreg <= 255))
            and isinstance(cfg.warp_specialize, bool) and isinstance(cfg.tma, bool)):
        raise ValueError(f"not a valid config: {obj!r}")
    return cfg


def read(path: Path) -> TunedFile:
    """Parse a tuned-config file; ValueError (naming what is wrong) when it is not one."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read it as JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"not a tuned-config file (its \"format\" is not {FORMAT!r})")
    try:
        key = DeviceKey(**raw["key"])
        items = list(raw["entries"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed key or entries ({type(exc).__name__}: {exc})") from exc
    entries, bad = {}, []
    for item in items:
        try:
            kernel, cls = item["kernel"], KernelClass.parse(item["class"])
            if kernel not in KERNELS or cls.for_kernel(kernel) != cls:
                raise ValueError(f"kernel {kernel!r} with class {item['class']!r}")
            entries[(kernel, cls.id)] = config_from_json(item["config"])
        except (KeyError, TypeError, ValueError) as exc:
            bad.append(str(exc))
    if bad:
        _warn(path, f"{len(bad)} malformed entr{'y' if len(bad) == 1 else 'ies'} ignored ({bad[0]})")
    return TunedFile(key, entries, raw)


def write(path: Path, key: DeviceKey, target: str, entries: list[dict], **record) -> None:
    """Write a tuned-config file: ``entries`` are dicts with kernel, class (id), config (a dict as
    config_to_json gives) and whatever the tuner records beside (times, speedups). Sorted, so a
    file's text depends only on its content."""
    entries = sorted(entries, key=lambda e: (KERNELS.index(e["kernel"]), e["class"]))
    obj = {"format": FORMAT, "key": key._asdict(), "target": target, **record, "entries": entries}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)  # never a half-written file where a launcher reads


# ---- the launchers' lookup

_WARNED: set = set()
_TABLES: dict = {}  # DeviceKey -> {(kernel, class id): Entry}


def _warn(path, why: str) -> None:
    if (str(path), why) not in _WARNED:
        _WARNED.add((str(path), why))
        warnings.warn(f"coreattn: tuned configs in {path} not used: {why}", TunedConfigWarning, stacklevel=3)


def _load_user(key: DeviceKey) -> dict:
    cache = user_cache()
    if cache.suffix == ".json" or cache.is_file():
        path = cache
    else:
        path = cache / file_name(key)
        if cache.is_dir():  # files this GPU left with other versions: stale after an upgrade
            for other in sorted(cache.glob(_device_prefix(key) + "*.json")):
                if other != path:
                    _warn(other, f"made with other versions than this process's triton {key.triton} / "
                                 f"coreattn {key.coreattn}; run python -m coreattn.tune again")
    if not path.is_file():
        return {}
    try:
        found = read(path)
    except ValueError as exc:
        _warn(path, str(exc))
        return {}
    if found.key != key:
        _warn(path, f"it is for {found.key.gpu} (compute capability {found.key.capability}), triton "
                    f"{found.key.triton}, coreattn {found.key.coreattn}; this process runs {key.gpu} "
                    f"({key.capability}), triton {key.triton}, coreattn {key.coreattn}")
        return {}
    return {k: Entry(cfg, path) for k, cfg in found.entries.items()}


def _load_shipped(key: DeviceKey) -> dict:
    table = {}
    for path in sorted(PACKAGE_DIR.glob("*.json")):
        try:
            found = read(path)
        except ValueError as exc:
            _warn(path, str(exc))
            continue
        if found.key == key:
            table.update({k: Entry(cfg, path) for k, cfg in found.entries.items()})
    return table


def table(key: DeviceKey) -> dict:
    """{(kernel, class id): Entry} for a device key: the user cache over the shipped files."""
    if key not in _TABLES:
        _TABLES[key] = {**_load_shipped(key), **_load_user(key)}
    return _TABLES[key]


def lookup(device: torch.device, kernel: str, cls: KernelClass) -> Entry | None:
    """The tuned entry for ``kernel`` at launch class ``cls`` on a CUDA ``device``, or None."""
    entries = table(device_key(device))
    if not entries:
        return None
    cls = cls.for_kernel(kernel)
    return entries.get((kernel, cls.id)) or entries.get((kernel, cls._replace(gqa=not cls.gqa).id))


def reject(use, exc: BaseException) -> None:
    """A launch with a tuned config (``use``: configs/pick.py ``ConfigUse``) failed to compile: drop that entry
    for the rest of the process, with one warning naming its file."""
    path = use.source.removeprefix("tuned: ")
    for entries in _TABLES.values():
        for k, entry in list(entries.items()):
            if str(entry.path) == path and k[0] == use.kernel and entry.config._replace(fp_fusion=None) == \
                    use.config._replace(fp_fusion=None):
                del entries[k]
    _warn(path, f"the {use.kernel} config {config_to_json(use.config)} for {use.cls} failed to compile "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}); "
                "using the shipped table")


def reload() -> None:
    """Forget what was read: the next lookup reads the files again (the tuner calls it after writing)."""
    _TABLES.clear()
    _WARNED.clear()
