"""Issue 26 items 1 and 3: the model interface (shuffledp.models.ModelPlugin), model plug-ins selected by [model]
module (shuffledp.models.plugin), and a node refusing a round whose model digest differs (over real processes)."""

from __future__ import annotations

import json
import math
import os

import grpc
import numpy as np
import pytest
from _procs import serve, stop, write_blobs
from _runs import wait_for_run
from shuffledp.clients.policy import Refusal

from shuffledp.cli.run import write_results
from shuffledp.config import ConfigError, parse_config
from shuffledp.mechanisms.pvec import clip_rows
from shuffledp.models import Model, ModelPlugin, clip_l2, make_model, model_digest
from shuffledp.models.plugin import PLUGINS_ENV, build_model, model_identity, registered_plugins
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg


def _plugin_toml(hidden: int, extra: str = "") -> str:
    return (
        '[model]\nmodule = "shuffledp.models:builtin"\nradius = 50.0\n'
        f'[model.args]\ntask = "mlp"\nhidden = {hidden}\n[schedule]\nlearning_rate = 0.5\n{extra}'
    )


# ------------------------------------------------------------------------------------------- the interface
@pytest.mark.parametrize("task", ["logreg", "leastsq", "hinge", "mlp"])
def test_builtin_models_implement_the_interface(task):
    rng = make_rng(7)
    m = make_model(task, 5, 3, hidden=4)
    assert isinstance(m, ModelPlugin)
    assert sum(math.prod(seg["shape"]) for seg in m.layout()) == m.dim
    X = rng.normal(size=(6, 3, 5))
    y = (rng.random((6, 3)) < 0.5).astype(np.int64)
    theta = m.init_params() + 0.1 * rng.normal(size=m.dim)
    # per_user_gradients = the mean of each user's per-example gradients (the node's former arithmetic)
    want = m.per_example_gradients(theta, X.reshape(18, 5), y.reshape(18)).reshape(6, 3, m.dim).mean(axis=1)
    np.testing.assert_allclose(m.per_user_gradients(theta, X, y), want, rtol=0, atol=0)
    # clipped: the protocols' l2 clipping, row by row
    np.testing.assert_allclose(m.per_user_gradients(theta, X, y, clip_norm=0.05), clip_rows(want, 0.05), atol=1e-15)
    clipped = m.per_user_gradients(theta, X, y, clip_norm=0.05)
    assert np.all(np.sqrt(np.einsum("ij,ij->i", clipped, clipped)) <= 0.05)  # the norm clip_rows guarantees


def test_nonconvex_constants_are_unknown_and_seed_is_public():
    m = make_model("mlp", 5, 3, hidden=4)
    assert not m.convex
    with pytest.raises(ValueError, match="non-convex"):
        m.lipschitz_bound(1.0)
    np.testing.assert_array_equal(m.init_params(), m.init_params(0))  # MLP_INIT_SEED = 0: unchanged default
    assert not np.array_equal(m.init_params(1), m.init_params(0))
    assert make_model("logreg", 5, 3).lipschitz_bound(1.0) == pytest.approx(math.sqrt(2) * math.sqrt(2))


def test_clip_l2_keeps_rows_inside():
    G = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(clip_l2(G, 1.0), [[0.6, 0.8], [0.3, 0.4], [0, 0]])


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    "toml, match",
    [
        ('[model]\nmodule = "./mymodel.py:make"\n', "an installed module, not a path"),
        ('[model]\nmodule = "mymodel"\n', "package.module:factory"),
        ("[model]\nmodule = 3\n", "model.module must be a string"),
        ("[model.args]\nhidden = 3\n", "set model.module"),
        ('[model]\nmodule = "a.b:c"\nl2 = 0.1\n', "model.l2 applies to the built-in tasks"),
        ('[model]\nmodule = "a.b:c"\nargs = 3\n', "model.args must be a table"),
    ],
)
def test_config_refuses_bad_model_module(toml, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(toml)


def test_config_reads_module_and_args():
    cfg = parse_config(_plugin_toml(8))
    assert cfg.model.module == "shuffledp.models:builtin"
    assert dict(cfg.model.args) == {"task": "mlp", "hidden": 8}
    assert parse_config("").model.module == ""  # the default run: the built-in task


@pytest.mark.parametrize(
    "module, match",
    [
        ("numpy:zeros", "neither a ModelPlugin subclass nor a factory marked"),  # installed, but not a model factory
        ("os:system", "neither a ModelPlugin subclass nor a factory marked"),
        ("shuffledp_no_such_module:f", "cannot import"),
        ("shuffledp.models:no_such_factory", "has no 'no_such_factory'"),
    ],
)
def test_loader_imports_only_marked_factories(module, match, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, module)  # registered by this party: still only a marked factory is called
    cfg = parse_config(f'[model]\nmodule = "{module}"\n[schedule]\nlearning_rate = 0.1\n')
    with pytest.raises(ConfigError, match=match):
        build_model(cfg.model, 3, 2)


def test_loader_never_imports_an_unregistered_module(monkeypatch):
    """Importing runs a module's top level: `this` prints, `antigravity` opens a browser, numpy.f2py.__main__ runs
    f2py on the process's argv (issue 43 item 5). Whatever is installed, an unregistered module is refused before
    it is imported; the project's own plug-ins are registered by its entry points, the environment adds others."""
    import sys

    monkeypatch.setenv(PLUGINS_ENV, " shuffledp_elsewhere:make ,")
    for name in ("this", "antigravity", "numpy.f2py.__main__", "shuffledp.models.examples.flax_models"):
        # an earlier test of the session may have imported it (the Flax examples): out of sys.modules until this
        # test ends, so that an import here would show
        monkeypatch.delitem(sys.modules, name, raising=False)
        cfg = parse_config(f'[model]\nmodule = "{name}:f"\n[schedule]\nlearning_rate = 0.1\n')
        with pytest.raises(ConfigError, match=f"'{name}:f' is not a model plug-in registered here") as err:
            build_model(cfg.model, 3, 2)
        assert "\n" not in str(err.value)
        assert name not in sys.modules
    assert registered_plugins() == {
        "shuffledp.models:builtin",
        "shuffledp.models.examples.flax_models:cnn",
        "shuffledp.models.examples.flax_models:mlp",
        "shuffledp_elsewhere:make",
    }


def test_loader_reports_bad_arguments():
    cfg = parse_config(_plugin_toml(8) + "").model
    bad = parse_config(_plugin_toml(8).replace("hidden = 8", "hidden = 8\nwidth = 3")).model
    assert isinstance(build_model(cfg, 3, 2), Model)
    with pytest.raises(ConfigError, match="refused model.args"):
        build_model(bad, 3, 2)


def test_digest_covers_definition_and_layout():
    c8, c4 = parse_config(_plugin_toml(8)).model, parse_config(_plugin_toml(4)).model
    m8, m4 = build_model(c8, 3, 2), build_model(c4, 3, 2)
    a, b = model_identity(c8, m8), model_identity(c4, m4)
    assert a.name == b.name == "shuffledp.models:builtin" and a.digest != b.digest
    assert model_identity(c8, build_model(c8, 3, 2)) == a  # deterministic
    assert model_identity(c8, build_model(c8, 4, 2)).digest != a.digest  # another layout
    # the plug-in digest is not the built-in's: it also covers the factory's name, arguments and source
    assert model_digest(m8) != a.digest
    default = parse_config("").model
    assert model_identity(default, build_model(default, 3, 2)).name == "logreg"


def test_nonconvex_plugin_needs_a_learning_rate():
    from shuffledp.planning import PlanError, plan_run

    cfg = parse_config(_plugin_toml(4).replace("learning_rate = 0.5", "rounds = 2"))
    model = build_model(cfg.model, 3, 2)
    with pytest.raises(PlanError, match="non-convex.*schedule.learning_rate"):
        plan_run(cfg, 100, 100, model, 1.0)
    plan = plan_run(parse_config(_plugin_toml(4)), 100, 100, model, 1.0)
    assert plan["model_name"] == "shuffledp.models:builtin" and plan["task"] == "" and plan["dim"] == model.dim


# ----------------------------------------------------------------------------- over real processes
@pytest.mark.timeout(300)
def test_node_refuses_a_round_whose_model_digest_differs(tmp_path):
    """One shuffler, one analyzer, one client node, each `shuffledp serve ...` as an OS process. The node's own
    configuration installs the plug-in mlp with 4 hidden units. A run of that model completes through the plug-in
    path; a run whose configuration asks for 3 hidden units (another digest) is refused by every user of the node
    with Refusal.MODEL_DIFFERS and nothing is released."""
    data = write_blobs(tmp_path / "blobs.npz", n=120)
    deploy = "[deployment]\nclient_nodes = 1\nround_deadline_seconds = 20.0\n"
    node_cfg = tmp_path / "node.toml"
    node_cfg.write_text(data + _plugin_toml(4))
    procs = []
    try:
        sh, sport = serve(tmp_path, "shuffler", ["shuffler", "--insecure", "--state-dir", str(tmp_path / "sh")])
        procs.append(sh)
        shuffler = f"127.0.0.1:{sport}"
        node, nport = serve(
            tmp_path,
            "node0",
            ["client", "--insecure", "--shuffler", shuffler, "--config", str(node_cfg)]
            + ["--state-dir", str(tmp_path / "node0")],
        )
        procs.append(node)
        an, aport = serve(
            tmp_path, "analyzer", ["analyzer", "--insecure", "--shuffler", shuffler, "--state-dir", str(tmp_path / "a")]
        )
        procs.append(an)
        stub = pbg.AnalyzerStub(grpc.insecure_channel(f"127.0.0.1:{aport}"))

        def run(toml: str) -> pb.RunResult:
            run_id = stub.CreateRun(pb.CreateRunRequest(config_toml=toml), timeout=120).run_id
            stub.StartRun(pb.RunRef(run_id=run_id), timeout=30)
            wait_for_run(stub, run_id, timeout=200)
            return stub.GetRunResult(pb.RunRef(run_id=run_id), timeout=30)

        def refusals() -> dict[str, int]:
            with grpc.insecure_channel(f"127.0.0.1:{nport}") as ch:
                return dict(pbg.ClientNodeStub(ch).GetNodeStatus(pb.NodeStatusRequest(), timeout=10).refusals)

        same = run(data + _plugin_toml(4, "rounds = 2\n") + deploy)
        assert same.status.state == pb.COMPLETED, same.status.message
        assert same.status.rounds_done == 2 and Refusal.MODEL_DIFFERS not in refusals()
        assert np.isfinite(same.accuracy) and len(same.model.f64) == 8 * (4 * 4 + 2 * 5)
        # export (item 5): model.npz names the plug-in's segments, in its layout
        write_results(tmp_path / "out", data + _plugin_toml(4), same)
        npz = np.load(tmp_path / "out" / "model.npz")
        layout = json.loads(str(npz["layout"]))
        assert layout["model"] == "shuffledp.models:builtin" and layout["arrays"] == {"W1": [4, 4], "W2": [2, 5]}
        np.testing.assert_array_equal(np.concatenate([npz["W1"].ravel(), npz["W2"].ravel()]), npz["params"])

        other = run(data + _plugin_toml(3, "rounds = 1\n") + deploy)
        users = 90  # 120 examples, every 4th held out
        assert refusals().get(Refusal.MODEL_DIFFERS) == users
        # the operator reads the reason in the round's report; nothing of the round is released or charged
        last = other.status.metrics[-1]
        assert not last.released and last.contributors == 0
        assert dict(last.refused_reasons) == {Refusal.MODEL_DIFFERS: users}
        assert other.status.budget.eps_spent == 0
        log = (tmp_path / "node0.log").read_text()
        assert "refusing round 0" in log and "node has 'shuffledp.models:builtin'" in log
    finally:
        stop(*procs)


def test_a_party_registers_a_plug_in_for_itself_and_the_processes_it_starts(monkeypatch):
    """`shuffledp run` registers the plug-in its own configuration names (register_plugin): in its environment, which
    the services it starts inherit; once, however often it is registered."""
    import subprocess
    import sys

    from shuffledp.models.plugin import register_plugin

    monkeypatch.setenv(PLUGINS_ENV, "")  # restored after the test (delenv of an unset variable is not)
    for _ in range(2):
        register_plugin("mine_elsewhere:make")
        register_plugin("shuffledp.models:builtin")  # registered by the entry point already
    assert os.environ[PLUGINS_ENV] == "mine_elsewhere:make"
    code = (
        "from shuffledp.models.plugin import registered_plugins; print('mine_elsewhere:make' in registered_plugins())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True", proc.stderr


@pytest.mark.timeout(180)
def test_create_run_never_imports_an_unregistered_module(tmp_path, monkeypatch):
    """Issue 43 item 5 acceptance: an analyzer (an OS process) whose sys.path holds two model modules, each writing a
    file when it is imported; its environment registers one (SHUFFLEDP_MODEL_PLUGINS). A CreateRun naming the other
    is refused with one line (INVALID_ARGUMENT) and that module's top level never ran; one naming the registered
    module is created (and imported it)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name in ("registered_model", "unregistered_model"):
        (plugins / f"{name}.py").write_text(
            f"from pathlib import Path\nPath({str(tmp_path / name)!r} + '.imported').write_text('ran')\n"
            "from shuffledp.models import builtin as make\n"
        )
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    monkeypatch.setenv(PLUGINS_ENV, "registered_model:make")
    data = write_blobs(tmp_path / "blobs.npz", n=60)
    procs = []
    try:
        sh, sport = serve(tmp_path, "shuffler", ["shuffler", "--insecure", "--state-dir", str(tmp_path / "sh")])
        procs.append(sh)
        argv = ["analyzer", "--insecure", "--shuffler", f"127.0.0.1:{sport}", "--state-dir", str(tmp_path / "a")]
        an, aport = serve(tmp_path, "analyzer", argv)
        procs.append(an)
        with grpc.insecure_channel(f"127.0.0.1:{aport}") as channel:
            stub = pbg.AnalyzerStub(channel)

            def create(module: str) -> pb.RunStatus:
                toml = data + _plugin_toml(4).replace("shuffledp.models:builtin", module)
                return stub.CreateRun(pb.CreateRunRequest(config_toml=toml), timeout=60)

            with pytest.raises(grpc.RpcError) as err:
                create("unregistered_model:make")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.value.details()
            assert "'unregistered_model:make' is not a model plug-in registered here" in details
            assert "\n" not in details
            assert not (tmp_path / "unregistered_model.imported").exists()
            assert create("registered_model:make").run_id
            assert (tmp_path / "registered_model.imported").exists()
            assert not (tmp_path / "unregistered_model.imported").exists()
    finally:
        stop(*procs)


def test_a_spec_never_makes_a_node_import_what_it_names():
    """A spec naming a plug-in the node does not have (or another built-in digest) is refused by every invited user
    with Refusal.MODEL_DIFFERS; the named module is not imported and nothing is charged."""
    import sys

    from shuffledp.clients.node import NodeCore, UserShard
    from shuffledp.clients.policy import UserPolicy

    rng = make_rng(1)
    shard = UserShard([f"u{j}" for j in range(6)], rng.normal(size=(6, 1, 3)), rng.normal(size=(6, 1)))
    spec = pb.RoundSpec(
        run_id="run",
        round=0,
        schedule=pb.FULLY_INTERACTIVE,
        trust_model=pb.SHUFFLE,
        transport=pb.COUNTS,
        randomizer=pb.RandomizerSpec(protocol="pvec", dim=4, g=16, m=8, p=0.5, clip_norm=1.0),
        model=pb.Tensor(shape=[4], f64=np.zeros(4).tobytes()),
        task="leastsq",
        min_contributors=1,
        deadline_seconds=10,
        per_user_cost=pb.PrivacyCost(eps=1.0, delta=1e-6, trust_model=pb.SHUFFLE),
        local_batch=1,
    )
    good = model_digest(make_model("leastsq", 3, 1))
    for name, digest, refused in [
        ("shuffledp_never_imported_xyz:factory", good, True),
        ("leastsq", "0" * 64, True),  # a built-in of another layout or version
        ("leastsq", good, False),
        ("", "", False),  # a spec that states no model (earlier analyzers): the built-in task as before
    ]:
        core = NodeCore("n", shard, UserPolicy(verify_randomizer=False), rng=make_rng(2))
        out = core.handle(pb.Invitation(spec=_with_model(spec, name, digest), user_ids=shard.user_ids))
        reasons = {r.reason for r in out.refusals}
        assert (reasons == {Refusal.MODEL_DIFFERS}) == refused, (name, reasons)
        assert (core.spent("u0")[0] == 0) == refused
    assert "shuffledp_never_imported_xyz" not in sys.modules
    # a node with a plug-in refuses a built-in spec (it computes only with the model its configuration names)
    cfg = parse_config(_plugin_toml(4)).model
    plugin = build_model(cfg, 3, 2)
    core = NodeCore("n", shard, UserPolicy(verify_randomizer=False), model=(plugin, model_identity(cfg, plugin)))
    out = core.handle(pb.Invitation(spec=_with_model(spec, "leastsq", good), user_ids=shard.user_ids))
    assert {r.reason for r in out.refusals} == {Refusal.MODEL_DIFFERS}


def _with_model(spec: pb.RoundSpec, name: str, digest: str) -> pb.RoundSpec:
    out = pb.RoundSpec()
    out.CopyFrom(spec)
    out.model_name, out.model_digest = name, digest
    return out


def test_a_plug_ins_failing_export_leaves_the_results_written(tmp_path, monkeypatch, capsys):
    """ModelPlugin.export is the user's code: whatever it raises (here a RuntimeError, which escaped before) is a
    one-line warning; model.npz and the rest stay written."""
    from shuffledp.cli.run import _export_plugin

    (tmp_path / "broken_export_model.py").write_text(
        "import dataclasses\n"
        "from shuffledp.models import make_model, model_factory\n"
        "def export(self, params, directory):\n"
        "    raise RuntimeError('disk full in the framework')\n"
        "@model_factory\n"
        "def make(num_features, num_classes):\n"
        "    m = make_model('logreg', num_features, num_classes)\n"
        "    broken = type('Broken', (type(m),), {'export': export})\n"
        "    return broken(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.init})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "broken_export_model:make")
    toml = '[model]\nmodule = "broken_export_model:make"\n[schedule]\nlearning_rate = 0.1\n'
    plan = {"num_features": 3, "num_classes": 2, "model_name": "broken_export_model:make"}
    _export_plugin(tmp_path, toml, plan, np.zeros(8))
    err = capsys.readouterr().err
    assert "only model.npz written: RuntimeError: disk full in the framework" in err


def test_the_default_run_imports_no_jax():
    """JAX is an optional extra: the parties of the default run (built-in model, PVEC) never import it."""
    code = (
        "import sys\n"
        "import shuffledp.cli.run, shuffledp.services.analyzer, shuffledp.services.shuffler, shuffledp.clients.node\n"
        "from shuffledp.config import parse_config, DEFAULT_TOML\n"
        "from shuffledp.models.plugin import build_model\n"
        "from shuffledp.protocols.registry import round_protocol\n"
        "cfg = parse_config(DEFAULT_TOML)\n"
        "round_protocol(cfg.privacy.protocol)\n"
        "build_model(cfg.model, 64, 10)\n"
        "heavy = ('jax', 'jaxlib', 'flax', 'jax_privacy', 'optax')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
