"""Device mesh and sharding rules: one code path from 1 CPU to a multi-host pod.

The mesh has two axes, ``data`` and ``fsdp``. The batch is split over both (every device gets a
different slice of examples). Parameters and optimiser state are replicated over ``data`` and, when
``fsdp > 1``, split over ``fsdp`` (ZeRO-3 style): each tensor large enough is cut along its largest
dimension divisible by the ``fsdp`` size; XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
FSDP_MIN_SIZE = 2 ** 14  # smaller tensors stay replicated: sharding them costs more than it saves


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
  """A ``(data, fsdp)`` mesh (``data=-1``: all devices that ``fsdp`` leaves).

  An explicit ``data * fsdp`` smaller than the device count uses the first devices only (for
  debugging and for comparing device counts in one process).
  """
  devices = jax.devices() if devices is None else devices
  n = len(devices)
  if not isinstance(fsdp, int) or fsdp < 1 or n % fsdp:
    raise ValueError(f"mesh.fsdp={fsdp} is not allowed; it must divide the device count {n}")
  if data == -1:
    data = n // fsdp
  if not isinstance(data, int) or data < 1 or data * fsdp > n:
    raise ValueError(f"mesh.data={data} is not allowed; mesh.data x mesh.fsdp ({fsdp}) must be "
                     f"at most the device count {n} (or mesh.data=-1 for all)")
  if data * fsdp < n and jax.process_count() > 1:
    raise ValueError(f"mesh.data={data} x mesh.fsdp={fsdp} must use all {n} devices when "
                     "running on several processes")
  return Mesh(device_grid(devices[:data * fsdp], data, fsdp), ("data", "fsdp"))


def device_grid(devices, data: int, fsdp: int) -> np.ndarray:
  """The ``(data, fsdp)`` array of ``devices`` a mesh is made of.

  On TPUs the order follows the physical torus (``mesh_utils.create_device_mesh``: each ``fsdp``
  group on neighbouring chips, so its all-gathers ride the interconnect), and over several slices
  (``device.slice_index``, a multi-slice job) ``data`` is split across the slices, which talk over
  the data-centre network (DCN), while ``fsdp`` stays within one (``create_hybrid_device_mesh``).
  Elsewhere (CPU, GPU) and for a subset of a slice: the devices in their order.
  """
  devices = list(devices)
  if devices[0].platform != "tpu":
    return np.asarray(devices).reshape(data, fsdp)
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1 and data % slices:
    raise ValueError(f"mesh.data={data} is not allowed on {slices} slices; it must be a multiple "
                     "of the slice count (the data-parallel replicas span the slices)")
  try:
    if slices > 1:
      return mesh_utils.create_hybrid_device_mesh((data // slices, fsdp), (slices, 1), devices,
                                                   allow_split_physical_axes=True)
    return mesh_utils.create_device_mesh((data, fsdp), devices, allow_split_physical_axes=True)
  except (AssertionError, NotImplementedError, ValueError):  # no physical layout: device order
    return np.asarray(devices).reshape(data, fsdp)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (example) axis split over all devices."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def fsdp_spec(shape, fsdp_size: int, min_size: int = FSDP_MIN_SIZE) -> P:
  """Partition spec of one parameter: its largest dimension divisible by ``fsdp_size``."""
  if fsdp_size == 1 or int(np.prod(shape)) < min_size:
    return P()
  for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % fsdp_size == 0:
      spec = [None] * len(shape)
      spec[axis] = "fsdp"
      return P(*spec)
  return P()


def param_shardings(abstract: Any, mesh: Mesh) -> Any:
  """NamedShardings for a tree of (abstract) arrays under the FSDP rule."""
  size = mesh.shape["fsdp"]
  return jax.tree_util.tree_map(lambda a: NamedSharding(mesh, fsdp_spec(a.shape, size)), abstract)


def check_batch(global_batch: int, mesh: Mesh, accum_steps: int = 1) -> None:
  """One-line errors for batches the mesh cannot split evenly."""
  n = mesh.size
  if global_batch % (n * accum_steps):
    raise ValueError(f"batch_size={global_batch} is not allowed; it must be divisible by the "
                     f"device count {n} x accum_steps {accum_steps} = {n * accum_steps}")
  if global_batch % jax.process_count():
    raise ValueError(f"batch_size={global_batch} must be divisible by the process count "
                     f"{jax.process_count()}")


def global_batch_from_local(local: Any, mesh: Mesh) -> Any:
  """Per-process numpy batch -> global ``jax.Array`` split over the batch axes.

  Leaves that are already ``jax.Array``s (a device-resident stream builds the global batch on the
  devices) are only placed on the batch sharding, which is free when they are already on it.
  """
  sharding = batch_sharding(mesh)

  def put(x):
    if isinstance(x, jax.Array):
      return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree_util.tree_map(put, local)
