"""Small-scale study on one GPU: alpha_min 0.6 / 0.8 / 1.0 at ten times the CPU grid's budget.

Command: bash launch/gpu_study.sh OUTDIR   (NPZ=path/to/cifar10_train10k.npz; see that script)
  which runs, once per arm and all three at once on the one GPU,
  python -m research.small_scale_study.run --config=research/small_scale_study/config_gpu.py \
      --workdir=OUTDIR/study --grid=long --long_epochs=300 --only=ARM
Hardware: one NVIDIA H200 (three training processes share it), 16 host cores.
Expected time: about 11 minutes for the three arms on one H200 (measured rate 2026-12-04: 25-31
  steps/s per arm, bound by the host's input pipeline, before the batches were built on the GPU),
  4 with EPOCHS=100; each arm logs its steps/s and ETA.
Expected result: not finished yet. The first run stopped at about epoch 120 with the baseline ahead
  at every logged KNN (docs/study.md, "On one GPU"), as the CPU grid's 100-epoch arms were.

The recipe is the CPU study's (research/small_scale_study/config.py: MAE-tiny/4, 32 px CIFAR-10,
8,000 training images, batch 128, lr 1e-3, 2 warm-up epochs, bfloat16 nowhere: float32 as on CPU);
only what scales with the length changes: KNN during training every 30 epochs instead of 3,
checkpoints and pictures every 100 epochs, and no TensorBoard files (metrics.jsonl only). The
training images live on the GPU and each batch is cropped and flipped there (``data.on_device``,
docs/data.md): the host only picks the step's record indices, so the three processes no longer
share 16 host cores for augmentation.
``get_config("cpu_check")`` is the same run shrunk to seconds (the micro model, 16 px, 0.5 epochs
of 160 images, small probes) for ``BENCH_PLATFORM=cpu bash launch/gpu_study.sh``: a check of the
script on any machine, whose numbers mean nothing.
"""

from research.small_scale_study import config as cpu_study

STEPS_PER_EPOCH = cpu_study.STEPS_PER_EPOCH
EPOCHS = 300.0  # ten times the CPU grid's 30 epochs (three times its 100-epoch arms)


def get_config(arg=None):
  c = cpu_study.get_config()
  c.num_epochs = EPOCHS
  c.tensorboard = False
  c.checkpoint.every_steps = 100 * STEPS_PER_EPOCH
  c.picture_every_steps = 100 * STEPS_PER_EPOCH
  c.log_every_steps = 10 * STEPS_PER_EPOCH
  c.evals.knn.every_steps = 30 * STEPS_PER_EPOCH
  c.data.on_device = True  # always here (the CPU grid sets it too): no host augmentation
  if arg == "cpu_check":
    _shrink(c)
  elif arg:
    raise ValueError(f"config argument {arg!r} is not allowed; choose cpu_check or none")
  return c


def _shrink(c):
  """The micro model on 16-pixel images, 160 to train and 64 to test, half an epoch."""
  c.model.preset = "micro/4"
  c.data.image_size = 16
  c.data.train_split = "train[:160]"
  c.data.eval_split = "train[160:]"
  c.batch_size = 16
  c.num_epochs = 0.5
  c.warmup_epochs = 0.0
  c.log_every_steps = 1
  c.picture_every_steps = 0
  c.checkpoint.every_steps = 5
  for name in ("knn", "linear", "layers"):
    e = c.evals[name]
    e.train_split, e.eval_split, e.batch_size = "train[:160]", "train[160:]", 64
  c.evals.layers.probe_epochs = 2
  c.evals.layers.probe_batch_size = 32
  c.evals.rank.split = "train[160:]"
  c.evals.rank.num_images = 32
  c.evals.rank.batch_size = 32
  c.evals.linear.official.update(epochs=2, batch_size=32)
  # A check of the script, not of the probes (tests/test_study.py covers those): one protocol and
  # one feature, KNN at the end only.
  c.evals.knn.every_steps = 0
  c.evals.linear.update(protocols="official", features="mean")
