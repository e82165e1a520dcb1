"""Tasks: what differs between MAE, fine-tuning, SiT and U-ViT training (``base.Task`` lists what a
task answers). A task is registered by being a ``base.Task`` subclass with a ``name`` in a module
of this folder, found by name here; this is the one place where a config's ``task`` maps to a class,
and everything else asks the task object (its model builder, default config, evaluators, samplers).

A new task is one new file in this folder (and the configs that train it).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Sequence, Type, Union

from decay_jax import validate
from decay_jax.train import checkpoint
from decay_jax.train.tasks.base import Task


def _discover() -> Dict[str, Type[Task]]:
  """``{name: class}`` of the ``Task`` subclasses defined in this folder's modules."""
  found = {}
  for info in pkgutil.iter_modules(__path__):
    module = importlib.import_module(f"{__name__}.{info.name}")
    for value in vars(module).values():
      if (isinstance(value, type) and issubclass(value, Task) and value.name
          and value.__module__ == module.__name__):
        found[value.name] = value
  return dict(sorted(found.items()))


TASKS: Dict[str, Type[Task]] = _discover()


def get(name: str) -> Type[Task]:
  """The task class of a config's ``task`` field; a one-line error names the choices."""
  validate.check_choice("task", name, tuple(TASKS))
  return TASKS[name]


def from_config(config, model, info) -> Task:
  """The task object of a training config over ``model`` (``info``: ``pipeline.dataset_info``)."""
  return get(config.task).from_config(config, model, info)


def build_model(config, info, pretrained=None):
  """The Flax model of a training config (its task's ``build_model``)."""
  return get(config.task).build_model(config, info, pretrained)


def run_config(workdir: str, task: Union[None, str, Sequence[str]] = None):
  """The config a run was trained with over today's defaults of its task
  (``checkpoint.run_config``); ``task``, a name or several, rejects runs of other tasks in one
  line (None: any task)."""
  names = (task,) if isinstance(task, str) else tuple(task or TASKS)
  return checkpoint.run_config(workdir, [get(n) for n in names])
