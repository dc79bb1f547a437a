"""The ``kvplug`` command and the example third-party plugin, installed for real into a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvplug
from kvplug.cli import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "third_party_plugin"


def run_kvplug(*args: str, pythonpath: str | None = None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, str(REPO), env.get("PYTHONPATH")]))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def script_output(script: str, *args: str, pythonpath: str) -> str:
    """Run ``python -c script args...`` with ``pythonpath`` first; its stdout (it must exit 0)."""
    result = run_kvplug("-c", script, *args, pythonpath=pythonpath)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory) -> str:
    """Build and install examples/third_party_plugin (a real wheel build) into a private directory."""
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert list(target.glob("kvplug_pagehash-0.1.0.dist-info"))
    return str(target)


def test_plugins_json_lists_the_installed_example(installed_example):
    result = run_kvplug("-m", "kvplug", "plugins", "--json", pythonpath=installed_example)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == 1 and report["interface_version"] == kvplug.INTERFACE_VERSION
    plugins = {plugin["name"]: plugin for plugin in report["plugins"]}
    example = plugins["pagehash"]
    assert example["distribution"] == "kvplug-pagehash" and example["version"] == "0.1.0"
    assert example["builtin"] is False and example["file"].endswith("kvplug_pagehash/plugin.py")
    assert example["provides"] == {"prefix_cache": ["page-hash"], "kv_store": ["dir"]}
    assert plugins["kvplug.builtin.prefix_caches"]["provides"]["prefix_cache"] == ["naive", "radix"]
    assert report["load_failures"] == []


def test_example_plugin_is_created_by_name_and_passes_the_conformance_kit(installed_example):
    script = (
        "import kvplug, kvplug.testing\n"
        "cache = kvplug.create_prefix_cache('page-hash', page_size=4)\n"
        "assert type(cache).__name__ == 'PageHashPrefixCache', type(cache)\n"
        "from kvplug_pagehash.cache import PageHashPrefixCache\n"
        "kvplug.testing.check_prefix_cache(PageHashPrefixCache, page_sizes=(1, 4))\n"
        "print('conformant')\n"
    )
    result = run_kvplug("-c", script, pythonpath=installed_example)
    assert result.returncode == 0, result.stderr
    assert "conformant" in result.stdout


def test_example_store_is_chosen_by_url_through_its_entry_point_and_passes_the_kit(installed_example, tmp_path):
    """Issue 30: a third-party KV store, installed with its entry point, is built from a URL by
    its scheme and passes the conformance kit (two stores on one directory share pages)."""
    script = (
        "import sys, kvplug, kvplug.testing\n"
        "url = 'dir://' + sys.argv[1]\n"
        "manager = kvplug.PluginManager()\n"
        "store = manager.create_kv_store(url)\n"
        "assert type(store).__name__ == 'DirectoryKVStore', type(store)\n"
        "assert manager.providers('kv_store')['dir'] == 'pagehash'\n"
        "kvplug.testing.check_kv_store(lambda: manager.create_kv_store(url))\n"
        "print('conformant')\n"
    )
    assert "conformant" in script_output(script, str(tmp_path / "pages"), pythonpath=installed_example)


def test_a_backend_loads_what_another_evicted_through_the_example_store(installed_example, tmp_path):
    """Issue 30, through the public API only: ``create_backend(..., remote_kv="dir://...")`` with
    the third-party store; a second backend loads the first one's evicted prefix from it, K/V
    identical, and a backend of another model id loads nothing."""
    script = (
        "import sys, torch, kvplug\n"
        "from kvplug.memory.model_shape import ModelShape\n"
        "shape = ModelShape(2, 2, 2, 8, torch.float32)\n"
        "url, page = 'dir://' + sys.argv[1], 4\n"
        "prompt = [(7 * i) % 50 + 1 for i in range(6 * page + 1)]\n"
        "def backend(model='tiny'):\n"
        "    return kvplug.create_backend(shape, page_size=page, num_pages=8, max_running_reqs=2,\n"
        "        max_seq_len=16 * page, attention=None, prefix_cache='radix',\n"
        "        prefix_cache_options={'host_memory': 16 * page * shape.kv_bytes_per_token()},\n"
        "        remote_kv=url, remote_kv_model=model)\n"
        "def value(tokens, start, end):  # what a model would compute for these positions\n"
        "    ids = torch.tensor(tokens[start:end], dtype=torch.float32)\n"
        "    return (ids[None, None, :, None, None] + torch.arange(64.).view(2, 2, 1, 2, 8))\n"
        "def serve(b):\n"
        "    rows = b.pool.kv_buffer.view(2, 2, -1, 2, 8)\n"
        "    request = b.admit(prompt)\n"
        "    matched = request.matched_len\n"
        "    hit = b.page_table[request.row, :matched].long()\n"
        "    assert torch.equal(rows[:, :, hit], value(prompt, 0, matched)), 'loaded K/V differs'\n"
        "    b.allocate([request])\n"
        "    out = b.page_table[request.row, request.cached_len:request.device_len].long()\n"
        "    rows[:, :, out] = value(prompt, request.cached_len, request.device_len)\n"
        "    b.finish(request, computed=True)\n"
        "    b.check_integrity()\n"
        "    return matched\n"
        "first = backend()\n"
        "assert serve(first) == 0\n"
        "first.evict_prefix_cache(6 * page)\n"
        "first.prefix_cache.flush_remote_kv()  # the store writes are done\n"
        "assert serve(backend()) == 6 * page, 'the second backend recomputed what the store holds'\n"
        "assert serve(backend('another-model')) == 0\n"
        "print('shared')\n"
    )
    assert "shared" in script_output(script, str(tmp_path / "pages"), pythonpath=installed_example)


def test_disabling_the_example_hides_it(installed_example):
    result = run_kvplug(
        "-m", "kvplug", "plugins", "--json", pythonpath=installed_example,
        env_extra={"KVPLUG_DISABLE_PLUGINS": "pagehash"},
    )
    names = {plugin["name"] for plugin in json.loads(result.stdout)["plugins"]}
    assert "pagehash" not in names and "kvplug.builtin.prefix_caches" in names


def test_plugins_table(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["PLUGIN", "DISTRIBUTION", "VERSION", "PROVIDES"]
    assert "prefix_cache: naive, radix" in out and "kv_pool: mha" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "plugins" in capsys.readouterr().out


def test_python_dash_m_and_version():
    result = run_kvplug("-m", "kvplug", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvplug {kvplug.__version__}"


def test_plugins_command_lists_skipped_plugins_and_exits_0(tmp_path):
    from tests.plugin_fixtures import SOURCES, make_distribution

    make_distribution(tmp_path, "fake-shadow", "1.0", "shadow", "cli_shadow_plugin",
                      SOURCES["colliding"].replace("{cache_name}", "radix"))
    make_distribution(tmp_path, "fake-exiter", "2.0", "exiter", "cli_exiter_plugin", SOURCES["exit-on-import"])
    make_distribution(tmp_path, "fake-hooked", "3.0", "hooked", "cli_hooked_plugin", SOURCES["raising-hook"])
    plain = run_kvplug("-m", "kvplug", "plugins", pythonpath=str(tmp_path))
    assert plain.returncode == 0, plain.stderr
    assert "prefix_cache: naive, radix" in plain.stdout and plain.stderr == ""
    skipped = [line for line in plain.stdout.splitlines() if line.startswith("skipped: ")]
    assert [line.split()[1] for line in skipped] == ["exiter", "hooked", "shadow"]
    assert "called sys.exit(3) on import" in skipped[0] and "this hook is broken on purpose" in skipped[1]
    assert "'kvplug.builtin.prefix_caches' and by plugin 'shadow'" in skipped[2]

    result = run_kvplug("-m", "kvplug", "plugins", "--json", pythonpath=str(tmp_path),
                        env_extra={"KVPLUG_DISABLE_PLUGINS": "transformers"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    failures = {failure["entry_point"]: failure for failure in report["load_failures"]}
    assert sorted(failures) == ["exiter", "hooked", "shadow"]
    assert failures["exiter"]["distribution"] == "fake-exiter" and failures["exiter"]["version"] == "2.0"
    assert failures["shadow"]["error"].startswith("DuplicateComponentError: prefix_cache 'radix' is registered twice")
    assert {plugin["name"] for plugin in report["plugins"]}.isdisjoint(failures)
    filtered = {entry["entry_point"]: entry["why"] for entry in report["filtered_out"]}
    if "transformers" in filtered:  # only where the transformers host plugin is installed
        assert filtered["transformers"] == "KVPLUG_DISABLE_PLUGINS lists it"

    strict = run_kvplug("-m", "kvplug", "plugins", pythonpath=str(tmp_path), env_extra={"KVPLUG_STRICT_PLUGINS": "1"})
    assert strict.returncode == 2 and "KVPLUG_STRICT_PLUGINS is set" in strict.stderr


# ------------------------------------------------------------- start-up weight (causes, not timings)


def test_version_and_plugin_loading_import_no_torch():
    script = (
        "import sys\n"
        "from kvplug.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0\n"
        "assert 'torch' not in sys.modules, 'kvplug --version imported torch'\n"
        "assert not [name for name in sys.modules if name.startswith('kvplug.cli.')], 'a command was imported'\n"
        "import kvplug\n"
        "from kvplug import hookimpl\n"
        "manager = kvplug.PluginManager(entry_points=False)\n"
        "assert manager.available('prefix_cache') == ['naive', 'radix']\n"
        "assert 'torch' not in sys.modules, 'loading the built-in plugins imported torch'\n"
        "print('light')\n"
    )
    result = run_kvplug("-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"kvplug {kvplug.__version__}", "light"]


def test_plugins_and_capacity_import_no_torch(tmp_path):
    """``kvplug plugins`` and ``kvplug capacity`` (a config file or flags) answer without torch."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "torch_dtype": "bfloat16",
    }))
    script = (
        "import sys\n"
        "from kvplug.cli import main\n"
        f"assert main(['capacity', {str(tmp_path)!r}, '--memory', '40GiB', '--context-len', '4096']) == 0\n"
        "assert main(['capacity', '--layers', '2', '--kv-heads', '2', '--head-dim', '8', '--memory', '1MiB']) == 0\n"
        "assert main(['plugins']) == 0\n"
        "assert 'torch' not in sys.modules, 'a command imported torch'\n"
        "print('light')\n"
    )
    result = run_kvplug("-c", script)
    assert result.returncode == 0, result.stderr
    assert "pages that fit: 23,404 of 16 token(s)" in result.stdout and result.stdout.splitlines()[-1] == "light"


def test_the_installed_example_plugin_registers_without_importing_torch(installed_example):
    """A third-party plugin's hook runs for every ``kvplug`` command: the example's imports torch only
    when its cache is built (issue 29 item 7)."""
    script = (
        "import sys\n"
        "from kvplug.cli import main\n"
        "assert main(['plugins']) == 0\n"
        "assert 'torch' not in sys.modules, 'registering the example plugin imported torch'\n"
        "import kvplug\n"
        "cache = kvplug.create_prefix_cache('page-hash', page_size=4)\n"
        "assert 'torch' in sys.modules and type(cache).__name__ == 'PageHashPrefixCache'\n"
        "print('light')\n"
    )
    result = run_kvplug("-c", script, pythonpath=installed_example)
    assert result.returncode == 0, result.stderr
    assert "page-hash" in result.stdout and result.stdout.splitlines()[-1] == "light"


@pytest.mark.parametrize("command", [["plugins"], ["plugins", "--json"], ["--version"]])
def test_a_closed_pipe_ends_the_command_without_a_traceback(command):
    """``kvplug plugins | head``: the reader leaving is no error worth a traceback (issue 29 item 9)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte
    try:
        result = subprocess.run([sys.executable, "-m", "kvplug", *command], stdout=write, stderr=subprocess.PIPE,
                                text=True, env=env, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode in (0, 141), result.returncode


def test_every_public_name_and_sub_package_is_importable_from_the_top_level():
    script = (
        "import kvplug\n"
        "namespace = {}\n"
        "exec('from kvplug import *', namespace)\n"
        "missing = [name for name in kvplug.__all__ if name not in namespace]\n"
        "assert not missing, missing\n"
        "from kvplug import BasePrefixCache, create_backend, INTERFACE_VERSION, hookimpl\n"
        "assert kvplug.BasePrefixCache is BasePrefixCache and INTERFACE_VERSION == 1\n"
        "assert kvplug.testing.check_prefix_cache and kvplug.memory.PageTable and kvplug.interface.KVPlugError\n"
        "assert set(kvplug.__all__) <= set(dir(kvplug))\n"
        "try:\n"
        "    kvplug.no_such_name\n"
        "except AttributeError as error:\n"
        "    assert 'no_such_name' in str(error)\n"
        "else:\n"
        "    raise AssertionError('kvplug.no_such_name did not raise')\n"
        "print('ok')\n"
    )
    result = run_kvplug("-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_only_the_command_run_is_imported():
    from kvplug.cli import command_names, commands_to_register

    assert {"bench", "capacity", "plugins", "serve"} <= set(command_names())
    assert commands_to_register(["plugins", "--json"]) == ["plugins"]
    assert commands_to_register(["--version"]) == []
    assert commands_to_register(["--help"]) is None and commands_to_register([]) is None
    assert commands_to_register(["no-such-command"]) is None


def test_mistyped_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plugin"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'plugin'" in err and "'plugins'" in err and "'capacity'" in err


def test_bench_help_is_plain_text_without_references_outside_the_repository(capsys):
    from kvplug.bench import discover_suites

    suites, _ = discover_suites()
    assert {"e2e", "prefix-cache", "host-step"} <= set(suites)
    for argv in (["bench", "--help"], *(["bench", suite, "--help"] for suite in sorted(suites))):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "usage: kvplug bench" in out
        assert "``" not in out and "SPEC" not in out and "../shared" not in out, (argv, out)
