"""TrainConfig: defaults, dict/file loading, type and choice checks, precedence, ``ddpkit train`` flags.

Only argument *parsing* is exercised for the CLI; nothing is launched.
"""
import dataclasses
import json

import pytest

from ddpkit.cli import build_parser
from ddpkit.job.config import TrainConfig, config_from_dict, load_config_file, merge
from ddpkit.base.errors import ConfigError, DDPKitError
from ddpkit.cli.train import resolve


# --------------------------------------------------------------------------- defaults


def test_defaults():
    cfg = TrainConfig()
    assert (cfg.nproc, cfg.engine, cfg.backend, cfg.accelerator) == ("auto", "ddp", None, "auto")
    assert (cfg.device_data, cfg.compile, cfg.tf32) == ("auto", False, True)
    assert (cfg.model, cfg.data, cfg.epochs, cfg.batch_size) == ("small_cnn", "digits", 12, 64)
    assert (cfg.lr, cfg.optimizer, cfg.scheduler, cfg.precision) == (0.05, "sgd", "cosine", "fp32")
    assert (cfg.accum_steps, cfg.clip_grad, cfg.comm_hook, cfg.max_steps) == (1, None, None, None)
    assert (cfg.timeout_s, cfg.ckpt_every_minutes) == (600.0, 0.0)
    assert isinstance(cfg.timeout_s, float)
    assert cfg.progress is True and cfg.ckpt_every_epoch is True
    assert cfg.channels_last is False and cfg.augment is False and cfg.sync_bn is False


def test_config_from_dict_without_values_is_the_defaults():
    assert config_from_dict({}) == TrainConfig()


def test_every_field_has_help_text():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"field {f.name} has no help text"


def test_every_default_satisfies_its_choices():
    for f in dataclasses.fields(TrainConfig):
        choices = f.metadata.get("choices")
        if choices and f.default is not None:
            assert f.default in choices, f.name


def test_to_dict_has_every_field():
    d = TrainConfig(epochs=3).to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert d["epochs"] == 3


# --------------------------------------------------------------------------- config_from_dict


def test_values_applied_and_dashes_in_keys_become_underscores():
    cfg = config_from_dict({"batch-size": 128, "clip-grad": 1.5, "channels_last": True, "epochs": 3})
    assert (cfg.batch_size, cfg.clip_grad, cfg.channels_last, cfg.epochs) == (128, 1.5, True, 3)
    assert cfg.lr == TrainConfig().lr  # untouched keys keep their defaults


def test_base_is_kept_and_not_mutated():
    base = TrainConfig(epochs=7, lr=0.2)
    cfg = config_from_dict({"lr": 0.3}, base)
    assert (cfg.epochs, cfg.lr) == (7, 0.3)
    assert base.lr == 0.2


def test_unknown_key_named_with_close_match():
    with pytest.raises(ConfigError, match=r"^unknown config key 'bach-size'; did you mean 'batch_size'\?$"):
        config_from_dict({"bach-size": 3})


def test_unknown_key_without_close_match_has_no_hint():
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"zzzqqq": 1})
    assert str(exc.value) == "unknown config key 'zzzqqq'"


def test_config_error_is_a_user_error():
    with pytest.raises(DDPKitError):
        config_from_dict({"epochs": "3"})


def test_string_for_int_names_key_and_value():
    with pytest.raises(ConfigError, match=r"^config key 'epochs' must be of type int, got str '3'$"):
        config_from_dict({"epochs": "3"})


def test_float_for_int_rejected():
    with pytest.raises(ConfigError, match=r"config key 'batch_size' must be of type int, got float 1\.5"):
        config_from_dict({"batch_size": 1.5})


def test_bool_for_int_rejected():
    with pytest.raises(ConfigError, match=r"config key 'epochs' must be of type int, got bool True"):
        config_from_dict({"epochs": True})


@pytest.mark.parametrize("key", ["lr", "timeout_s", "clip_grad", "ckpt_every_minutes"])
def test_int_accepted_for_float_and_converted(key):
    cfg = config_from_dict({key: 2})
    value = getattr(cfg, key)
    assert value == 2.0 and type(value) is float


def test_bool_for_float_rejected():
    with pytest.raises(ConfigError, match=r"config key 'lr' must be of type float, got bool True"):
        config_from_dict({"lr": True})


def test_numeric_string_for_float_accepted_and_other_strings_rejected():
    assert config_from_dict({"lr": "0.1"}).lr == 0.1
    with pytest.raises(ConfigError, match=r"config key 'lr' must be of type float, got str 'fast'"):
        config_from_dict({"lr": "fast"})


@pytest.mark.parametrize("value", [1, 0, 1.0, "yes", "true"])
def test_bool_field_requires_a_real_bool(value):
    with pytest.raises(ConfigError, match=r"^config key 'augment' must be true or false, got "):
        config_from_dict({"augment": value})


@pytest.mark.parametrize("key", ["epochs", "augment", "lr", "model"])
def test_null_rejected_for_non_optional_fields(key):
    with pytest.raises(ConfigError, match=f"config key {key!r}"):
        config_from_dict({key: None})


def test_bool_field_accepts_bools():
    assert config_from_dict({"augment": True, "progress": False}).augment is True
    assert config_from_dict({"progress": False}).progress is False


def test_none_accepted_for_optional_fields():
    cfg = config_from_dict({"clip_grad": None, "backend": None, "max_steps": None},
                           TrainConfig(clip_grad=1.0, backend="gloo", max_steps=5))
    assert (cfg.clip_grad, cfg.backend, cfg.max_steps) == (None, None, None)


@pytest.mark.parametrize("key,bad,choices", [
    ("optimizer", "rmsprop", "sgd, adam, adamw"),
    ("precision", "fp8", "fp32, bf16, fp16"),
    ("engine", "deepspeed", "ddp, fsdp, dp, horovod, none"),
    ("scheduler", "linear", "none, cosine, step, onecycle"),
    ("accelerator", "tpu", "auto, cpu, cuda"),
    ("comm_hook", "int8", "fp16, bf16, powersgd, powersgd-batched, auto"),
])
def test_choices_enforced(key, bad, choices):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({key: bad})
    assert str(exc.value) == f"config key {key!r} must be one of {choices}, got {bad!r}"


def test_choice_check_uses_normalised_key():
    with pytest.raises(ConfigError, match=r"config key 'comm_hook' must be one of"):
        config_from_dict({"comm-hook": "zip"})


def test_valid_choices_accepted():
    cfg = config_from_dict({"optimizer": "adamw", "precision": "bf16", "comm_hook": "powersgd",
                            "scheduler": "onecycle", "engine": "none"})
    assert (cfg.optimizer, cfg.precision, cfg.comm_hook, cfg.scheduler, cfg.engine) == (
        "adamw", "bf16", "powersgd", "onecycle", "none")


def test_optional_choice_field_accepts_none():
    assert config_from_dict({"comm_hook": None}, TrainConfig(comm_hook="fp16")).comm_hook is None


# --------------------------------------------------------------------------- files


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name", ["train.yaml", "train.yml"])
def test_yaml_file(tmp_path, name):
    path = _write(tmp_path, name, "epochs: 3\nbatch-size: 128\nlr: 0.1\nclip_grad: null\n"
                                  "augment: true\nmodel: resnet18\n")
    assert load_config_file(path) == {"epochs": 3, "batch-size": 128, "lr": 0.1,
                                      "clip_grad": None, "augment": True, "model": "resnet18"}


def test_toml_file(tmp_path):
    path = _write(tmp_path, "train.toml", 'epochs = 3\nbatch_size = 128\nlr = 0.1\n'
                                          'precision = "bf16"\nchannels_last = true\n')
    assert load_config_file(path) == {"epochs": 3, "batch_size": 128, "lr": 0.1,
                                      "precision": "bf16", "channels_last": True}


def test_json_file(tmp_path):
    path = _write(tmp_path, "train.json", '{"epochs": 3, "comm_hook": null, "lr": 1e-05}')
    assert load_config_file(path) == {"epochs": 3, "comm_hook": None, "lr": 1e-05}


def test_empty_yaml_file_is_an_empty_mapping(tmp_path):
    assert load_config_file(_write(tmp_path, "empty.yaml", "")) == {}
    assert load_config_file(_write(tmp_path, "comment.yaml", "# nothing yet\n")) == {}


def test_empty_toml_file_is_an_empty_mapping(tmp_path):
    assert load_config_file(_write(tmp_path, "empty.toml", "")) == {}


def _assert_one_line_malformed(path, exc):
    msg = str(exc.value)
    assert msg.startswith(f"config file {path!r} is malformed: ")
    assert "\n" not in msg
    assert len(msg) > len(f"config file {path!r} is malformed: ")  # the parser's reason is kept
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no chained traceback


def test_malformed_yaml(tmp_path):
    path = _write(tmp_path, "bad.yaml", "epochs: [1, 2\nlr: 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config_file(path)
    _assert_one_line_malformed(path, exc)


def test_malformed_toml(tmp_path):
    path = _write(tmp_path, "bad.toml", "epochs = \nlr = 0.1\n")
    with pytest.raises(ConfigError) as exc:
        load_config_file(path)
    _assert_one_line_malformed(path, exc)
    assert "line 1" in str(exc.value)  # tomllib says where


def test_malformed_json(tmp_path):
    path = _write(tmp_path, "bad.json", '{"epochs": 3,}')
    with pytest.raises(ConfigError) as exc:
        load_config_file(path)
    _assert_one_line_malformed(path, exc)


@pytest.mark.parametrize("name,text", [("list.yaml", "- 1\n- 2\n"), ("scalar.yaml", "42\n"),
                                       ("list.json", "[1, 2]")])
def test_non_mapping_file(tmp_path, name, text):
    path = _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as exc:
        load_config_file(path)
    assert str(exc.value) == f"config file {path!r} must hold a mapping of keys to values"


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as exc:
        load_config_file(path)
    assert str(exc.value) == f"config file {path!r} does not exist"


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(str(tmp_path))


# --------------------------------------------------------------------------- merge / precedence


def test_merge_precedence_defaults_file_flags(tmp_path):
    path = _write(tmp_path, "train.yaml", "epochs: 5\nbatch_size: 32\nlr: 0.2\n")
    cfg = merge(path, {"batch_size": 128})
    assert cfg.batch_size == 128        # flag beats file
    assert (cfg.epochs, cfg.lr) == (5, 0.2)  # file beats defaults
    assert cfg.model == TrainConfig().model  # default where neither says anything


def test_merge_without_file():
    assert merge(None, {"epochs": 2}) == TrainConfig(epochs=2)
    assert merge(None, {}) == TrainConfig()


def test_merge_checks_file_keys(tmp_path):
    path = _write(tmp_path, "train.toml", "epoch = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'epoch'; did you mean 'epochs'\?"):
        merge(path, {})


def test_merge_checks_file_types(tmp_path):
    path = _write(tmp_path, "train.yaml", "epochs: three\n")
    with pytest.raises(ConfigError, match=r"config key 'epochs' must be of type int, got str 'three'"):
        merge(path, {})


# --------------------------------------------------------------------------- dump round trip


def test_dump_round_trips(tmp_path):
    cfg = TrainConfig(epochs=3, batch_size=96, lr=0.125, clip_grad=1.5, comm_hook="bf16",
                      resume="auto", max_steps=40, weight_decay=1e-5, precision="bf16",
                      channels_last=True, progress=False, timeout_s=30.0)
    path = str(tmp_path / "config.json")
    cfg.dump(path)
    with open(path) as f:
        text = f.read()
    assert text.endswith("}\n")
    assert config_from_dict(json.loads(text)) == cfg
    assert config_from_dict(load_config_file(path)) == cfg
    assert merge(path, {}) == cfg


def test_dump_of_defaults_round_trips(tmp_path):
    path = str(tmp_path / "config.json")
    TrainConfig().dump(path)
    loaded = config_from_dict(load_config_file(path))
    assert loaded == TrainConfig()
    assert type(loaded.timeout_s) is float and type(loaded.ckpt_every_minutes) is float


# --------------------------------------------------------------------------- ddpkit train flags


def _resolve(*argv):
    return resolve(build_parser().parse_args(["train", *argv]))


def test_cli_no_flags_gives_defaults():
    ns = build_parser().parse_args(["train"])
    assert ns.command == "train" and ns.config is None
    assert resolve(ns) == TrainConfig()


def test_cli_flags():
    cfg = _resolve("--batch-size", "128", "--no-progress", "--channels-last", "--lr", "1e-3",
                   "--clip-grad", "1", "--precision", "bf16", "--comm-hook", "powersgd",
                   "--max-steps", "10", "--backend", "gloo")
    assert (cfg.batch_size, cfg.progress, cfg.channels_last) == (128, False, True)
    assert (cfg.lr, cfg.clip_grad, cfg.precision) == (0.001, 1.0, "bf16")
    assert type(cfg.clip_grad) is float
    assert (cfg.comm_hook, cfg.max_steps, cfg.backend) == ("powersgd", 10, "gloo")
    assert cfg.epochs == TrainConfig().epochs
    cfg = _resolve("--comm-hook", "powersgd-batched", "--powersgd-rank", "4",
                   "--powersgd-start-iter", "2")
    assert (cfg.comm_hook, cfg.powersgd_rank, cfg.powersgd_start_iter) == (
        "powersgd-batched", 4, 2)


def test_cli_positive_bool_flag():
    assert _resolve("--progress").progress is True
    assert _resolve("--no-channels-last").channels_last is False
    assert _resolve("--sync-bn", "--augment").sync_bn is True


def test_cli_launcher_flags_do_not_leak_into_config():
    ns = build_parser().parse_args(["train", "--nnodes", "2", "--node-rank", "1",
                                    "--max-restarts", "3", "--nproc", "4"])
    assert (ns.nnodes, ns.node_rank, ns.max_restarts) == ("2", 1, 3)
    assert resolve(ns) == TrainConfig(nproc=4)


def test_cli_config_file_then_flags(tmp_path):
    path = _write(tmp_path, "train.yaml", "epochs: 5\nbatch_size: 32\nprogress: false\n")
    cfg = _resolve("--config", path, "--batch-size", "128")
    assert (cfg.epochs, cfg.batch_size, cfg.progress) == (5, 128, False)


def test_cli_flag_not_given_does_not_override_file(tmp_path):
    # Flags default to SUPPRESS, so a bool in the file survives when its flag is absent.
    path = _write(tmp_path, "train.toml", "channels_last = true\nprogress = false\n")
    cfg = _resolve("--config", path)
    assert (cfg.channels_last, cfg.progress) == (True, False)
    assert _resolve("--config", path, "--progress").progress is True


def test_cli_bad_file_key_is_a_config_error(tmp_path):
    path = _write(tmp_path, "train.yaml", "batchsize: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'batchsize'; did you mean 'batch_size'\?"):
        _resolve("--config", path)


def test_cli_invalid_choice_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "--precision", "fp8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "invalid choice: 'fp8'" in err


def test_cli_bad_int_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--batch-size", "lots"])
    err = capsys.readouterr().err
    assert "--batch-size" in err and "invalid int value: 'lots'" in err


def test_yaml_exponent_without_dot_is_accepted(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-3 as a string; float keys accept it anyway.
    assert merge(_write(tmp_path, "train.yaml", "lr: 1e-3\n"), {}).lr == 0.001
    assert merge(_write(tmp_path, "ok.yaml", "lr: 1.0e-3\n"), {}).lr == 0.001


# ----------------------------------------------------------------------------- ranges (issue 22)

@pytest.mark.parametrize("key,bad,message", [
    ("timeout_s", 0, "--timeout-s must be > 0, got 0.0"),
    ("eval_batch_size", 0, "--eval-batch-size must be >= 1, got 0"),
    ("ckpt_keep", 0, "--ckpt-keep must be >= 1, got 0"),
    ("batch_size", -4, "--batch-size must be >= 1, got -4"),
    ("workers", -1, "--workers must be >= 0, got -1"),
    ("lr", float("nan"), "--lr must be a finite number"),
    ("clip_grad", 0.0, "--clip-grad must be > 0, got 0.0"),
    ("max_steps", 0, "--max-steps must be >= 1, got 0"),
])
def test_numbers_outside_their_range_are_one_line_naming_the_flag(key, bad, message):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({key: bad})
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_every_default_is_inside_its_range():
    from ddpkit.job.config import check_ranges
    check_ranges(TrainConfig())  # no error


# ----------------------------------------------------------------------------- run directories

def test_a_copied_run_directory_resumes_from_and_writes_to_itself(tmp_path, capsys):
    original = tmp_path / "run"
    (original / "checkpoints").mkdir(parents=True)
    TrainConfig(output=str(original), epochs=3).dump(str(original / "config.json"))
    copy = tmp_path / "copy"
    import shutil
    shutil.copytree(original, copy)
    cfg = merge(str(copy / "config.json"), {"resume": "auto"})
    assert cfg.output == str(copy) and cfg.epochs == 3
    assert "the run was moved or copied" in capsys.readouterr().err
    # --output given on the command line still wins
    assert merge(str(copy / "config.json"), {"output": "elsewhere"}).output == "elsewhere"


def test_a_run_directory_config_in_place_is_quiet_and_other_config_files_keep_their_output(
        tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    TrainConfig(output=str(run)).dump(str(run / "config.json"))
    assert merge(str(run / "config.json"), {}).output == str(run)
    assert capsys.readouterr().err == ""
    # a hand-written config.json that is not inside a run keeps its output
    (tmp_path / "config.json").write_text(json.dumps({"output": "runs/x"}))
    assert merge(str(tmp_path / "config.json"), {}).output == "runs/x"
