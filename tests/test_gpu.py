"""On a real CUDA GPU: what users run there. Marked ``gpu``: these skip with the reason on
machines without CUDA (CI), and ``make test-gpu`` runs only them. Several ranks share the one GPU
over gloo (NCCL needs a GPU per process).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import resume_script
from ddpkit.checkpoint.files import find_latest
from ddpkit.job.datasets import digits, synthetic
from ddpkit.job.images import InMemoryImages
from ddpkit.data.resident import choose_resident, resident_batches

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests")
CUDA0 = torch.device("cuda", 0)


def ddpkit(*args, timeout=300, env=None):
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "ddpkit", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def ok(res):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def results(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def final_weights(out):
    path, ckpt = find_latest(os.path.join(out, "checkpoints"))
    return ckpt["model"], ckpt["progress"]["step"]


# ----------------------------------------------------------------------------- the README's job

def test_default_train_uses_one_process_per_gpu(tmp_path):
    res = ok(ddpkit("train", "--epochs", "3", "--output", str(tmp_path)))
    assert "  nproc: 1\n" in res.stdout  # auto: one process per GPU
    assert "device cuda:0" in res.stdout
    assert "data on cuda:0" in res.stdout  # the digits were put on the GPU
    assert results(tmp_path)["final"]["eval/top1"] > 90


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains(tmp_path, precision):
    ok(ddpkit("train", "--nproc", "1", "--epochs", "4", "--precision", precision,
              "--output", str(tmp_path)))
    assert results(tmp_path)["final"]["eval/top1"] > 90


def test_fp16_grad_scaler_state_is_checkpointed(tmp_path):
    ok(ddpkit("train", "--nproc", "1", "--epochs", "1", "--precision", "fp16",
              "--output", str(tmp_path)))
    _path, ckpt = find_latest(tmp_path / "checkpoints")
    assert ckpt["precision"]["scaler"]["scale"] > 0


def test_two_processes_share_the_gpu_over_gloo_with_sync_bn(tmp_path):
    res = ok(ddpkit("train", "--nproc", "2", "--backend", "gloo", "--sync-bn", "--epochs", "3",
                    "--output", str(tmp_path)))
    assert "2 processes share 1 GPU(s) over gloo" in res.stderr
    assert results(tmp_path)["final"]["eval/top1"] > 90


def test_two_processes_under_nccl_on_one_gpu_is_one_line(tmp_path):
    if torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one GPU")
    res = ddpkit("train", "--nproc", "2", "--output", str(tmp_path))
    assert res.returncode != 0
    lines = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert lines == ["error: 2 processes on this node but only 1 CUDA device(s): NCCL needs one "
                     "GPU per process; use --nproc 1 (or auto), or --backend gloo to let "
                     "processes share a GPU (for testing, not speed)"], res.stderr


def test_one_process_is_on_the_gpu_without_a_process_group(tmp_path):
    # as Accelerate and Fabric do for one device; ddpkit's own collectives are no-ops there
    script = tmp_path / "one.py"
    script.write_text("import torch, torch.distributed as dist, ddpkit\n"
                      "rt = ddpkit.setup()\n"
                      "m = rt.wrap(torch.nn.Linear(2, 2))\n"
                      "print('one', rt.backend, rt.device, dist.is_initialized(),\n"
                      "      next(m.parameters()).device)\n")
    res = ok(ddpkit("run", "--nproc", "1", str(script)))
    assert "one None cuda:0 False cuda:0" in res.stdout


def test_data_parallel_engine(tmp_path):
    ok(ddpkit("train", "--engine", "dp", "--epochs", "3", "--output", str(tmp_path)))
    assert results(tmp_path)["final"]["eval/top1"] > 90


def test_compile_trains_and_saves_clean_names(tmp_path):
    ok(ddpkit("train", "--nproc", "1", "--compile", "--epochs", "2", "--output", str(tmp_path),
              timeout=600))
    weights, _ = final_weights(tmp_path)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in weights)
    assert results(tmp_path)["final"]["eval/top1"] > 85


# ----------------------------------------------------------------------------- resume

@pytest.mark.parametrize("nproc,backend", [(1, None), (2, "gloo")])
def test_kill_9_and_resume_on_cuda_is_bitwise_exact(tmp_path, nproc, backend):
    extra = ["--backend", backend] if backend else []
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    ref.mkdir(), killed.mkdir()
    ok(ddpkit("run", "--nproc", str(nproc), os.path.join(HERE, "resume_script.py"),
              "--out", str(ref), *extra))
    ok(ddpkit("run", "--nproc", str(nproc), "--max-restarts", "1",
              os.path.join(HERE, "resume_script.py"), "--out", str(killed),
              "--kill-rank", str(nproc - 1), "--kill-step", "7", *extra))
    a = torch.load(ref / "final.pt", weights_only=True)
    b = torch.load(killed / "final.pt", weights_only=True)
    assert a["step"] == b["step"] == 3 * resume_script.SAMPLES // 8
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_job_stopped_and_resumed_on_cuda_is_bitwise_exact_under_deterministic(tmp_path):
    common = ["--nproc", "1", "--deterministic", "--data", "synthetic", "--model", "resnet18",
              "--synthetic-samples", "512", "--batch-size", "64", "--epochs", "2",
              "--precision", "bf16", "--ckpt-every-steps", "4"]
    ok(ddpkit("train", *common, "--output", str(tmp_path / "ref")))
    ok(ddpkit("train", *common, "--max-steps", "6", "--output", str(tmp_path / "cut")))
    ok(ddpkit("train", *common, "--resume", "auto", "--output", str(tmp_path / "cut")))
    ref, ref_step = final_weights(tmp_path / "ref")
    cut, cut_step = final_weights(tmp_path / "cut")
    assert ref_step == cut_step == 16
    assert all(torch.equal(ref[k], cut[k]) for k in ref)


def test_checkpoint_moves_between_gpu_and_cpu(tmp_path):
    common = ["--nproc", "1", "--epochs", "2", "--ckpt-every-steps", "5"]
    gpu_first, cpu_first = str(tmp_path / "gpu_first"), str(tmp_path / "cpu_first")
    ok(ddpkit("train", *common, "--max-steps", "10", "--output", gpu_first))
    res = ok(ddpkit("train", *common, "--accelerator", "cpu", "--resume", "auto",
                    "--output", gpu_first))
    assert "resumed from" in res.stdout and final_weights(gpu_first)[1] == 46
    ok(ddpkit("train", *common, "--accelerator", "cpu", "--max-steps", "10", "--output", cpu_first))
    res = ok(ddpkit("train", *common, "--resume", "auto", "--output", cpu_first))
    assert "resumed from" in res.stdout and final_weights(cpu_first)[1] == 46


# ----------------------------------------------------------------------------- device data

def test_resident_batches_on_cuda_equal_those_on_cpu():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8, generator=g)
    ds = InMemoryImages(images, torch.randint(0, 10, (300,), generator=g), 10,
                        mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), augment=True)
    order = torch.randperm(300, generator=g).tolist()
    on_gpu = list(resident_batches(choose_resident(ds, CUDA0, "on"), order, 64, False, 3, 7))
    on_cpu = list(resident_batches(choose_resident(ds, torch.device("cpu"), "on"), order, 64,
                                   False, 3, 7))
    assert len(on_gpu) == len(on_cpu) == 5
    for (xg, yg), (xc, yc) in zip(on_gpu, on_cpu):
        assert xg.device.type == "cuda"
        assert torch.equal(yg.cpu(), yc)
        torch.testing.assert_close(xg.cpu(), xc, rtol=0, atol=1e-6)


def test_auto_puts_data_that_fits_on_the_gpu():
    assert choose_resident(digits(), CUDA0, "auto") is not None
    data = choose_resident(synthetic(1000), CUDA0, "auto")
    assert data.tensors[0].device.type == "cuda" and len(data) == 1000


def test_forcing_data_larger_than_the_gpu_is_one_line(tmp_path):
    free, _ = torch.cuda.mem_get_info()
    samples = int(free / (4 * 3 * 32 * 32)) + 1000
    res = ddpkit("train", "--nproc", "1", "--data", "synthetic", "--model", "resnet18",
                 "--synthetic-samples", str(samples), "--device-data", "on",
                 "--output", str(tmp_path))
    assert res.returncode != 0
    lines = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "device-resident data needs" in lines[0], res.stderr
    assert "--device-data off" in lines[0]


# ----------------------------------------------------------------------------- a user's own loop

OWN_LOOP = {  # tests/own_loop_script.py: augmentation from the global RNGs, 2 DataLoader workers
    "own-workers2-eval": ["--workers", "2", "--eval-every", "4"],
    "fit-workers2": ["--fit", "--workers", "2"],
    "own-fsdp": ["--engine", "fsdp", "--workers", "2"],
    # checkpoints written in the background from pinned host copies of the GPU state
    "own-async-workers2-eval": ["--workers", "2", "--eval-every", "4", "--async-save"],
    "own-fsdp-async": ["--engine", "fsdp", "--workers", "0", "--eval-every", "4", "--async-save"],
}
CASES = [(name, nproc, backend) for name in OWN_LOOP for nproc, backend in ((1, None), (2, "gloo"))
         if not ("fsdp" in name and backend == "gloo")]  # refused: the next test


def own_loop(out, nproc, backend, flags, restarts=0, env=None):
    os.makedirs(out, exist_ok=True)
    extra = ["--backend", backend] if backend else []
    return ddpkit("run", "--nproc", str(nproc), "--max-restarts", str(restarts),
                  os.path.join(HERE, "own_loop_script.py"), "--out", str(out), *extra, *flags,
                  env=env)


@pytest.mark.parametrize("name,nproc,backend", CASES)
def test_own_loop_kill_9_on_cuda_resumes_bitwise(tmp_path, name, nproc, backend):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    ok(own_loop(ref, nproc, backend, OWN_LOOP[name]))
    res = ok(own_loop(killed, nproc, backend, [*OWN_LOOP[name], "--kill-rank", str(nproc - 1),
                                               "--kill-step", "7"], restarts=1))
    assert "resumed from" in res.stdout + res.stderr
    a = torch.load(ref / "final.pt", weights_only=True)
    b = torch.load(killed / "final.pt", weights_only=True)
    assert a["step"] == b["step"] > 7
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_fsdp_over_gloo_on_one_gpu_is_one_line(tmp_path):
    # fully_shard over gloo with CUDA tensors died by SIGSEGV here (pytorch/pytorch#132471)
    res = own_loop(tmp_path, 2, "gloo", OWN_LOOP["own-fsdp"])
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "FSDP on GPUs needs NCCL" in lines[0], res.stderr[-3000:]


def test_own_loop_gpu_checkpoint_resumes_on_the_cpu(tmp_path):
    flags = OWN_LOOP["own-workers2-eval"]
    res = own_loop(tmp_path, 2, "gloo", [*flags, "--kill-rank", "1", "--kill-step", "7"])
    assert res.returncode != 0  # killed, no restart: the checkpoints are the GPU run's
    cpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = ok(own_loop(tmp_path, 2, None, [*flags, "--attempt", "1"], env=cpu))
    assert "resumed from" in res.stdout + res.stderr
    assert torch.load(tmp_path / "final.pt", weights_only=True)["step"] > 7


# ----------------------------------------------------------------------------- verify, run

def test_run_backend_gloo_shares_the_gpu(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os, ddpkit\nrt = ddpkit.setup()\n"  # one write: ranks share stdout
                      "os.write(1, f'rank {rt.rank} {rt.backend} {rt.device}\\n'.encode())\n")
    res = ok(ddpkit("run", "--nproc", "2", "--backend", "gloo", str(script)))
    assert sorted(l for l in res.stdout.splitlines() if l.startswith("rank")) == \
        ["rank 0 gloo cuda:0", "rank 1 gloo cuda:0"]


def test_verify_passes_the_readme_example_on_the_gpu(tmp_path):
    res = ok(ddpkit("verify", "--backend", "gloo", "--json", str(tmp_path / "v.json"),
                    "examples/train_ddpkit.py", timeout=600))
    assert "PASS" in res.stdout, res.stdout[-3000:]
