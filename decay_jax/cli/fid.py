"""FID, sFID, Inception Score, precision, recall, density and coverage of generated images.

    python -m decay_jax.cli.fid --samples=samples.npz --ref=VIRTUAL_imagenet256_labeled.npz \\
        --inception=/data/fid_inception
    python -m decay_jax.cli.fid --samples=/data/image_folder --inception=DIR --save_stats=ref.npz
    python -m decay_jax.cli.fid --samples=dataset:imagenet2012 --split=train --image_size=256 \\
        --data_dir=$TFDS --max_images=50000 --inception=DIR --save_stats=ref.npz

``--samples`` and ``--ref``: an ``.npz`` in ADM's layout (``arr_0`` uint8 ``(N, H, W, 3)`` images,
what ``decay_jax.cli.sample`` and ADM write, and/or the statistics ``mu``/``sigma``,
``mu_s``/``sigma_s`` of ADM's reference batches; pytorch-fid's ``--save-stats`` files hold
``mu``/``sigma``), a folder of images, or ``dataset:NAME``: the first ``--max_images`` images of
split ``--split`` (default ``train``, as ADM's reference batches) of ``data.dataset=NAME`` (any
image source; ``--data_dir`` for TFDS) centre-cropped to ``--image_size`` as ADM crops
(``data.eval_resize='adm'``), grey images repeated to RGB. As ADM's evaluator: FID and sFID use a file's own
statistics where it has them, else its images'; precision/recall (ADM's k = 3) and density/coverage
(prdc's k = 5) use the pool features of the images of both sides. ``--inception``: the FID
Inception converted from pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth`` with
``python -m decay_jax.cli.convert_external inception``. ``--save_stats`` writes a reference batch
in ADM's layout from ``--samples``: its statistics and ``arr_0``, ``--save_images`` of its images
drawn at random (ADM's batches hold 10,000), so that it serves this command and ADM's evaluator.
Features are computed sharded over this process's devices, with progress and ETA; the
nearest-neighbour metrics on the default device in blocks of ``--manifold_batch`` rows.
Prints the metrics and writes them to ``--out`` (JSON). docs/generation_metrics.md says what each
number follows.

The protocol is pytorch-fid's (see ``decay_jax/evals/generation.py`` for how it differs from ADM's
TensorFlow evaluator).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

from decay_jax import logs, paths, validate
from decay_jax.data import config as data_config
from decay_jax.data import pipeline
from decay_jax.evals import generation as gen
from decay_jax.evals import manifold
from decay_jax.models import inception as inception_lib
from decay_jax.train import checkpoint


DATASET = "dataset:"


def _needs_images(path: Optional[str]) -> bool:
  """An input without statistics: only its images' features can give FID."""
  return bool(path) and not (path.endswith(".npz") and gen.read_batch(path)[0].get("mu") is not None)


def dataset_images(spec: str, split: str, image_size: Optional[int], data_dir: Optional[str],
                   max_images: int) -> gen.ImageStream:
  """uint8 ``(N, S, S, 3)`` in chunks, read as the features are computed: the first
  ``max_images`` (0: all) images of ``split`` of ``dataset:NAME``, ADM's centre crop to
  ``image_size``, grey repeated to three channels."""
  name = spec[len(DATASET):]
  if not name:
    raise ValueError(f"{spec!r} is not allowed; write dataset:NAME with a data.dataset name, "
                     "e.g. dataset:embedded_mnist or dataset:imagenet2012")
  if not image_size:
    raise ValueError(f"--image_size is required with {spec!r} (the side of ADM's centre crop)")
  validate.check_int("image_size", image_size, 1)
  cfg = data_config.default_data_config()
  cfg.update(dataset=name, image_size=image_size, eval_resize="adm", data_dir=data_dir,
             max_eval_examples=max_images or None)
  n, chunks = pipeline.eval_stream(cfg, split)

  def rgb():
    for chunk in chunks:
      images = chunk["image"]
      if images.dtype != np.uint8:
        raise ValueError(f"{spec!r} is not allowed; its source holds latents, not images")
      yield np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
  return gen.ImageStream(n, rgb())


def _describe(path: str, a, model, params, keep: int, what: str):
  if path.startswith(DATASET):
    images = dataset_images(path, a.split, a.image_size, a.data_dir, a.max_images)
    return gen.describe_images(images, model, params, a.batch_size, None, keep, what)
  return gen.describe(path, model, params, a.batch_size, keep, what)


def _load_inception(directory: Optional[str]):
  if not directory:
    raise ValueError("--inception is required to compute features of images (convert "
                     "pt_inception-2015-12-05-6726825d.pth with decay_jax.cli.convert_external)")
  model, params = checkpoint.load_params(directory, "inception")
  inception_lib.check_loaded(model, directory)
  return model, params


def _fmt(v) -> str:
  return f"{v:.4f}" if isinstance(v, float) else str(v)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.fid", description=__doc__.split("\n")[0])
  p.add_argument("--samples", required=True, help="images: .npz (arr_0) or folder; or stats .npz")
  p.add_argument("--ref", help="reference: ADM batch / stats .npz, images .npz or folder")
  p.add_argument("--inception", help="converted FID Inception directory (convert_external)")
  p.add_argument("--save_stats", help="write a reference batch (ADM's layout) of --samples here")
  p.add_argument("--save_images", type=int, default=gen.REF_IMAGES,
                 help="images kept as arr_0 by --save_stats (random subset; ADM: 10000; 0: none)")
  p.add_argument("--batch_size", type=int, default=200, help="images per device batch (all devices)")
  p.add_argument("--is_split_size", type=int, default=5000, help="Inception Score split (ADM: 5000)")
  p.add_argument("--pr_k", type=int, default=manifold.PR_K, help="precision/recall k (ADM: 3)")
  p.add_argument("--dc_k", type=int, default=manifold.DC_K, help="density/coverage k (prdc: 5)")
  p.add_argument("--pr_dtype", choices=("float16", "float32"), default="float16",
                 help="precision/recall distances: ADM's float16 (float32 where not finite) or float32")
  p.add_argument("--manifold_batch", type=int, default=manifold.BATCH,
                 help="rows and columns per distance block (ADM: 10000)")
  p.add_argument("--out", help="also write the results as JSON here")
  p.add_argument("--split", default="train", help="dataset:...: the split (ADM's batches: train)")
  p.add_argument("--image_size", type=int, help="dataset:...: the side of ADM's centre crop")
  p.add_argument("--data_dir", help="dataset:...: the TFDS data directory")
  p.add_argument("--max_images", type=int, default=gen.REF_IMAGES,
                 help="dataset:...: the first N images of the split (0: all; they are held in memory)")
  a = p.parse_args(argv)

  logs.quiet_libraries()
  try:
    if not a.ref and not a.save_stats:
      raise ValueError("give --ref (to compute the metrics) and/or --save_stats (to write a "
                       "reference batch)")
    for field in ("batch_size", "is_split_size", "pr_k", "dc_k", "manifold_batch"):
      validate.check_int(field, getattr(a, field), 1)
    validate.check_int("save_images", a.save_images, 0)
    validate.check_int("max_images", a.max_images, 0)
    for field in ("samples", "ref", "inception"):
      path = getattr(a, field)
      if path and not path.startswith(DATASET) and not paths.exists(path):
        raise ValueError(f"--{field}={path!r} is not allowed; no such file or folder")
    model = params = None
    if a.inception or _needs_images(a.samples) or _needs_images(a.ref):
      model, params = _load_inception(a.inception)
    samples = _describe(a.samples, a, model, params, a.save_images if a.save_stats else 0,
                        "samples")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result = {"samples": a.samples}
  if "n" in samples:
    result["num_samples"] = int(samples["n"])
  if a.save_stats:
    gen.save_batch(a.save_stats, samples, samples.get("images"))
    kept = len(samples["images"]) if "images" in samples else 0
    print(f"wrote the reference batch of {a.samples} to {a.save_stats} "
          f"({', '.join(k for k in ('mu', 'sigma', 'mu_s', 'sigma_s') if k in samples)}; "
          f"arr_0: {kept} images)")
  missing = []
  if a.ref:
    try:
      ref = _describe(a.ref, a, model, params, 0, "reference")
      metrics, missing = gen.compare(samples, ref, a.is_split_size, a.pr_k, a.dc_k,
                                     a.pr_dtype == "float16", a.manifold_batch,
                                     names=(a.samples, a.ref))
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    result["ref"] = a.ref
    if "n" in ref:
      result["num_ref"] = int(ref["n"])
    result.update(metrics)
  elif "logits" in samples:
    result["inception_score"] = gen.inception_score(samples["logits"], a.is_split_size)
  print(" ".join(f"{k}={_fmt(v)}" for k, v in result.items()))
  if missing:
    why = ("give --inception (features of the images)" if model is None else
           "an input has statistics only, or no mu_s/sigma_s")
    print(f"not computed: {', '.join(missing)} ({why})")
  if a.out:
    paths.write_json(a.out, result)
  return 0


def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
