"""The files of a registered satp model (format 2: weights only) and its MLflow pyfunc.

A logged model is an MLflow pyfunc from code (:data:`PYFUNC_CODE`) whose artifacts are ``weights.pt``
(the state dict, fp32, CPU) and ``satp_model.json`` (format, ``weights_sha256``, task, model config,
vocabulary, data hash, commit, metrics, provenance, job, input). Nothing executable is stored:
:func:`read_model` rebuilds :class:`sat.SAT` from the JSON and fills it with tensors read by
``torch.load(weights_only=True)``, refusing weights that do not match ``weights_sha256``."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from pipeline.registry.record import META_FILE, WEIGHTS_FILE, read_meta  # there: the registry's record reads them too
from pipeline.tasks import Task, make_task
from sat.config import SATConfig

FORMAT = 2
#: artifact name -> file, as MLflow's pyfunc flavour lists them (MLmodel) and SATPyfunc reads them
ARTIFACTS = {"weights": WEIGHTS_FILE, "satp_model": META_FILE}
#: the models-from-code file MLflow runs to build the pyfunc model (written beside the model)
PYFUNC_CODE = '''\
"""satp's MLflow pyfunc model, built from the installed satp (nothing pickled)."""
import mlflow

from pipeline.registry.pyfunc import SATPyfunc

mlflow.models.set_model(SATPyfunc())
'''


@dataclasses.dataclass
class LoadedModel:
    """A registered model read back (:func:`read_model`): the module, its task, config, vocabulary and
    the version's ``satp_model.json``."""

    model: torch.nn.Module
    task: Task
    model_config: SATConfig
    vocab: Optional[list[str]]
    info: dict[str, Any]


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the registry stores it: fp32 floats on the CPU, each tensor its
    own storage (``torch.save`` of a view would write the whole storage it views)."""
    return {
        name: t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous().clone()
        for name, t in model.state_dict().items()
    }


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def write_files(state: Mapping[str, torch.Tensor], meta: dict[str, Any], directory: Path) -> dict[str, str]:
    """Write the weights and the JSON into ``directory``: ``{artifact name: path}`` to log."""
    torch.save(dict(state), directory / WEIGHTS_FILE)
    (directory / META_FILE).write_text(json.dumps(meta, default=str))
    return {name: str(directory / file) for name, file in ARTIFACTS.items()}


def _load_failure(exc: BaseException, path: Path) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words: its message is a paragraph of
    advice (to load without ``weights_only``, which satp never does) with terminal colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if "WeightsUnpickler error:" in text:
        after = text.split("WeightsUnpickler error:", 1)[1]
        first = next((line.strip() for line in after.splitlines() if line.strip()), "")
        detail = first.split(" was not an allowed global")[0].split(". ")[0].rstrip(".")
        return f"{detail}: it holds more than tensors" if detail.startswith("Unsupported global") else detail
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive: a cut one ends without its directory
        return f"not a complete zip archive as torch.save writes, {path.stat().st_size} bytes: truncated?"
    return " ".join(text.split()).split(". ")[0].rstrip(".")


def read_state(path: Path, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file; anything but a ``{name: tensor}`` dict is refused (one line;
    torch's warnings about the file are not shown: the line says what is wrong)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise ValueError(f"{where}: {path.name} is not a weights-only tensor file ({_load_failure(exc, path)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{where}: {path.name} holds {type(state).__name__}, expected a dict of named tensors")
    return state


def read_model(weights: Path, meta_file: Path, where: str) -> LoadedModel:
    """Rebuild a logged model from its two artifacts: no Python object but tensors is read, no
    stored code runs."""
    from pipeline import pyg_templates
    from sat import SAT

    meta = read_meta(meta_file, where)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: {meta_file.name} has format {meta.get('format')!r}, expected {FORMAT}")
    state = read_state(weights, where)
    if weights_sha256(state) != meta.get("weights_sha256"):
        raise ValueError(f"{where}: {weights.name} does not match the weights_sha256 of {meta_file.name}")
    pyg_templates.install()  # building the model renders PyG convs: no generated module left in $TMPDIR
    config = SATConfig.from_dict(meta["model_config"])
    model = SAT(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"{where}: {weights.name} does not fit its model_config "
                         f"({str(exc).splitlines()[-1].strip()[:160]})") from None
    vocab = meta.get("vocab")
    task_state = dict(meta["task"])
    task = make_task(task_state.pop("name"), vocab=vocab, **task_state)
    return LoadedModel(model=model.eval(), task=task, model_config=config, vocab=vocab, info=meta)

