"""Tasks: what differs between MAE, fine-tuning, SiT and U-ViT training (``base.Task`` lists what a
task answers). This is the one place where a config's ``task`` name maps to a class; everything
else asks the task object.

A new task is one new file in this folder with a ``base.Task`` subclass, and one entry in ``TASKS``.
"""

from __future__ import annotations

from typing import Dict, Type

from decay_jax import validate
from decay_jax.train.tasks.base import Task
from decay_jax.train.tasks.finetune import FinetuneTask
from decay_jax.train.tasks.mae import MAETask
from decay_jax.train.tasks.sit import SiTTask
from decay_jax.train.tasks.uvit import UViTTask

TASKS: Dict[str, Type[Task]] = {cls.name: cls for cls in (MAETask, SiTTask, FinetuneTask, UViTTask)}


def get(name: str) -> Type[Task]:
  """The task class of a config's ``task`` field; a one-line error names the choices."""
  validate.check_choice("task", name, tuple(TASKS))
  return TASKS[name]


def from_config(config, model, info) -> Task:
  """The task object of a training config over ``model`` (``info``: ``pipeline.dataset_info``)."""
  return get(config.task).from_config(config, model, info)
