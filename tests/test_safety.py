"""Safe defaults: the app listens on 127.0.0.1 only and makes no share link unless told to (and
no GRADIO_* environment variable can change that); --auth guards the UI and its API; no
session id can name a file outside the data folder; a model's own code runs only with
--trust-remote-code; weights and sessions are never unpickled."""

import ast
import builtins
import json
import pickle
from pathlib import Path

import gradio as gr
import httpx
import pytest
import torch
import transformers.dynamic_module_utils
from gradio_client import Client

import app as app_main
import h2o_chat.models.load as model_mod
from h2o_chat import ChatSession
from h2o_chat.chat import store
from h2o_chat.models.load import ModelLoadError, load_model
from tests.conftest import make_tiny_chat
from tests.live import call, free_port, live_app, save_tiny_chat, texts

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# What app.py hands to load_model and to launch


@pytest.fixture
def launched(monkeypatch):
    """Runs app.main with the tiny chat model and records what it asked for. real=True starts
    the real server (without blocking: the test closes it)."""
    calls = {}

    def fake_load(spec, **kwargs):
        calls["load"] = dict(kwargs, spec=spec)
        return make_tiny_chat()

    def run(argv, real=False):
        def launch(demo, **kwargs):
            calls["launch"], calls["demo"] = kwargs, demo
            if real:
                original_launch(demo, **kwargs, prevent_thread_lock=True, quiet=True)

        monkeypatch.setattr(gr.Blocks, "launch", launch)
        app_main.main(argv)
        return calls

    original_launch = gr.Blocks.launch
    monkeypatch.setattr(model_mod, "load_model", fake_load)
    yield run
    if "demo" in calls:
        calls["demo"].close()


def test_the_flags_default_to_private(tmp_path):
    args = app_main.parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.auth is None
    assert args.trust_remote_code is False


def listening_addresses(port):
    """(address, port) of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append((address, port))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
@pytest.mark.live
@pytest.mark.slow
def test_the_app_listens_on_localhost_only_with_no_share_link(launched, tmp_path, monkeypatch):
    # environment variables that would otherwise widen what Gradio exposes
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    monkeypatch.setenv("GRADIO_SHARE", "True")
    monkeypatch.setenv("GRADIO_SSR_MODE", "true")
    port = free_port()
    calls = launched(["--port", str(port), "--data-dir", str(tmp_path)], real=True)
    kwargs, demo = calls["launch"], calls["demo"]
    assert kwargs["server_name"] == "127.0.0.1" and kwargs["share"] is False and kwargs["ssr_mode"] is False
    assert kwargs["auth"] is None
    assert demo.share_url is None and not demo.share
    assert listening_addresses(port) == [("0100007F", port)]  # 127.0.0.1, and nothing else on that port
    assert httpx.get(f"http://127.0.0.1:{port}/config").status_code == 200


@pytest.mark.parametrize("argv, expected", [
    pytest.param(["--host", "0.0.0.0", "--api-key", "k"], dict(server_name="0.0.0.0", share=False), id="host"),
    pytest.param(["--share", "--auth", "a:b"], dict(server_name="127.0.0.1", share=True), id="share"),
])
def test_only_the_flags_widen_it(launched, tmp_path, argv, expected):
    kwargs = launched(argv + ["--data-dir", str(tmp_path)])["launch"]
    assert {k: kwargs[k] for k in expected} == expected


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0"], ["--host", "192.168.1.5"], ["--share"]],
                         ids=["any-address", "lan", "share"])
def test_a_reachable_server_without_any_credential_is_refused_in_one_line(launched, tmp_path, argv):
    with pytest.raises(SystemExit) as refused:
        launched(argv + ["--data-dir", str(tmp_path)])
    message = str(refused.value.code)
    assert message.startswith("h2o-chat: ") and "\n" not in message and "--api-key" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_this_machine_needs_no_credential(launched, tmp_path, host):
    assert launched(["--host", host, "--data-dir", str(tmp_path)])["launch"]["auth"] is None


def test_the_api_key_alone_is_the_pages_password(launched, tmp_path):
    login = launched(["--api-key", "k3y", "--data-dir", str(tmp_path)])["launch"]["auth"]
    assert callable(login) and login("anyone", "k3y") and not login("anyone", "wrong") and not login("k3y", "")
    assert launched(["--api-key", "k3y", "--auth", "a:b", "--data-dir", str(tmp_path)])["launch"]["auth"] == ("a", "b")


def test_a_data_folder_that_cannot_be_written_is_refused_in_one_line(launched, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as refused:
        launched(["--data-dir", str(blocker / "data")])
    message = str(refused.value.code)
    assert message.startswith("h2o-chat: --data-dir") and "cannot be written" in message and "\n" not in message


@pytest.mark.parametrize("argv, trusted", [
    pytest.param([], False, id="default"),
    pytest.param(["--trust-remote-code"], True, id="asked"),
])
def test_trust_remote_code_only_when_asked(launched, tmp_path, argv, trusted):
    assert launched(argv + ["--data-dir", str(tmp_path)])["load"]["trust_remote_code"] is trusted


@pytest.mark.parametrize("auth", ["alice", "alice:", ":s3cret", ""])
def test_a_malformed_auth_flag_is_refused(launched, tmp_path, auth):
    with pytest.raises(SystemExit, match="--auth must look like user:password"):
        launched(["--auth", auth, "--data-dir", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# --auth


SECRET = "the plan is under the lighthouse"


def serve_in_process(data, flags):
    """app.py FLAGS in this process on a free port (the tiny model), with a saved session holding
    SECRET in `data`; yields its URL, then closes it."""
    store.save(data, "secret-session", {"messages": [{"role": "user", "content": SECRET}]})
    calls = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_mod, "load_model", lambda spec, **kwargs: make_tiny_chat())
        original_launch = gr.Blocks.launch

        def launch(demo, **kwargs):
            calls["demo"] = demo
            original_launch(demo, **kwargs, prevent_thread_lock=True, quiet=True)

        mp.setattr(gr.Blocks, "launch", launch)
        port = free_port()
        app_main.main([*flags, "--port", str(port), "--data-dir", str(data)])
    yield f"http://127.0.0.1:{port}"
    calls["demo"].close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """app.py --auth alice:s3cret, with a saved session holding a secret."""
    yield from serve_in_process(tmp_path_factory.mktemp("data"), ["--auth", "alice:s3cret"])


@pytest.mark.parametrize("method, path", [
    ("GET", "/config"),
    ("GET", "/gradio_api/info"),
    ("POST", "/gradio_api/queue/join"),
    ("POST", "/gradio_api/call/send"),
    ("POST", "/gradio_api/run/send"),
    ("POST", "/gradio_api/upload"),
    ("GET", "/gradio_api/queue/data?session_hash=x"),
    ("GET", "/gradio_api/file=/etc/passwd"),
])
@pytest.mark.live
@pytest.mark.slow
def test_auth_guards_the_api(guarded, method, path):
    body = {"data": ["hi", "all", "all"], "fn_index": 0, "session_hash": "x"} if method == "POST" else None
    response = httpx.request(method, guarded + path, json=body)
    assert response.status_code == 401 and "Not authenticated" in response.text
    assert SECRET not in response.text and "secret-session" not in response.text


@pytest.mark.live
@pytest.mark.slow
def test_auth_shows_a_login_page_and_no_data(guarded):
    # (Gradio's login page does carry the API's schema: parameter names and defaults, no user data)
    page = httpx.get(guarded + "/").text
    assert '"auth_required":true' in page.replace(" ", "")
    assert SECRET not in page and "secret-session" not in page


@pytest.mark.parametrize("auth", [None, ("alice", "wrong"), ("mallory", "s3cret")],
                         ids=["none", "wrong-password", "wrong-user"])
@pytest.mark.live
@pytest.mark.slow
def test_auth_refuses_clients_without_the_login(guarded, auth):
    with pytest.raises(Exception, match="credentials were not provided|Could not login"):
        Client(guarded + "/", auth=auth, verbose=False)
    user, password = auth or ("", "")
    login = httpx.post(guarded + "/login", data={"username": user, "password": password})
    assert login.status_code in (400, 422) and not login.cookies


@pytest.mark.live
@pytest.mark.slow
def test_auth_lets_the_login_in(guarded):
    client = Client(guarded + "/", auth=("alice", "s3cret"), verbose=False)
    assert texts(call(client, "hi", api_name="/send")[2])[0] == ("user", "hi")
    assert "secret-session" in str(call(client, api_name="/saved_sessions"))


# ---------------------------------------------------------------------------------------------
# --api-key alone: nothing answers without the key


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """app.py --api-key KEY (no --auth), with a saved session holding a secret."""
    yield from serve_in_process(tmp_path_factory.mktemp("keyed-data"), ["--api-key", API_KEY])


API_KEY = "the-only-key"
API_ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/completions"), ("POST", "/completion"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/props"), ("GET", "/v1/anything")]


@pytest.mark.live
@pytest.mark.slow
def test_the_api_key_alone_guards_the_page_and_every_route(keyed):
    body = {"data": ["hi", "all", "all"], "fn_index": 0, "session_hash": "x"}
    for method, path in [("GET", "/config"), ("GET", "/gradio_api/info"), ("POST", "/gradio_api/queue/join"),
                         ("POST", "/gradio_api/call/send"), ("POST", "/gradio_api/run/send"),
                         ("GET", "/gradio_api/file=/etc/passwd")]:
        response = httpx.request(method, keyed + path, json=body if method == "POST" else None)
        assert response.status_code == 401, path
        assert SECRET not in response.text and "secret-session" not in response.text
    assert '"auth_required":true' in httpx.get(keyed + "/").text.replace(" ", "")
    for method, path in API_ROUTES:
        response = httpx.request(method, keyed + path, json={} if method == "POST" else None)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", path


@pytest.mark.live
@pytest.mark.slow
def test_the_api_key_opens_the_page_and_the_api(keyed):
    with pytest.raises(Exception, match="Could not login"):
        Client(keyed + "/", auth=("anyone", "wrong"), verbose=False)
    client = Client(keyed + "/", auth=("anyone", API_KEY), verbose=False)
    assert "secret-session" in str(call(client, api_name="/saved_sessions"))
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(keyed + "/health", headers=key).json()["status"] == "ok"
    assert httpx.post(keyed + "/tokenize", json={"content": "hi"}, headers=key).json() == {"tokens": [73, 74]}


# ---------------------------------------------------------------------------------------------
# Session ids never leave the data folder

BAD_IDS = {
    "parent": "../escape", "dotdot": "..", "dot": ".", "slash": "a/b", "absolute": "/etc/passwd",
    "backslash": "a\\b", "drive": "C:evil", "tilde": "~root", "url-encoded": "%2e%2e%2fescape", "nul": "a\x00b",
    "trailing-newline": "abc\n", "leading-space": " abc", "non-ascii": "é", "empty": "", "too-long": "x" * 65,
    "none": None, "int": 7,
}

OPENERS = {
    "check_id": lambda folder, sid: store.check_id(sid),
    "session_path": lambda folder, sid: store.session_path(folder, sid),
    "save": lambda folder, sid: store.save(folder, sid, {"messages": []}),
    "load": lambda folder, sid: store.load(folder, sid),
    "ChatSession": lambda folder, sid: ChatSession(*make_tiny_chat(), data_dir=folder, session_id=sid),
    "restore": lambda folder, sid: ChatSession.restore(*make_tiny_chat(), sid, folder),
}


@pytest.mark.parametrize("opener, session_id", [
    pytest.param(opener, session_id, id=f"{opener_name}-{id_name}")
    for opener_name, opener in OPENERS.items() for id_name, session_id in BAD_IDS.items()
    if not (opener_name == "ChatSession" and session_id is None)])  # None there means "make a new id"
def test_no_session_id_names_a_file_outside_the_data_folder(tmp_path, opener, session_id):
    folder = tmp_path / "data"
    (tmp_path / "escape.json").write_text(json.dumps({"version": 1, "messages": []}))  # a target to reach
    with pytest.raises(ValueError, match="invalid session id"):
        opener(folder, session_id)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["escape.json"]  # nothing written anywhere


def test_a_new_session_gets_a_valid_id(tmp_path):
    session = ChatSession(*make_tiny_chat(), data_dir=tmp_path)
    assert store.check_id(session.id) == session.id


def test_only_well_named_session_files_are_listed(tmp_path):
    for name in ("good-1.json", "a b.json", ".hidden.json", "x\n.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "folder.json").mkdir()
    assert store.list_ids(tmp_path) == ["good-1"]


@pytest.mark.live
@pytest.mark.slow
def test_the_app_restores_only_listed_sessions(tmp_path):
    from gradio_client.exceptions import AppError

    (tmp_path / "outside.json").write_text(json.dumps({"version": 1, "messages": [{"role": "user", "content": "x"}]}))
    with live_app(tmp_path / "data") as (url, _):
        client = Client(url, verbose=False)
        call(client, api_name="/saved_sessions")
        for session_id in ("../outside", "/etc/passwd", "..\\outside"):
            with pytest.raises(AppError, match="not in the list of choices"):
                call(client, session_id, api_name="/restore")


# ---------------------------------------------------------------------------------------------
# A model's own code runs only when asked


def evil_model(folder):
    """A model folder whose config names custom code; importing that code leaves a marker."""
    save_tiny_chat(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(
        f"open({str(folder / 'RAN')!r}, 'w').close()\n"
        "from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    return folder


def test_custom_model_code_is_refused_without_asking(tmp_path, monkeypatch):
    # left unset, transformers would ask on the terminal; a "y" there (or piped in) runs the code
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *args: asked.append(args) or "y")
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = evil_model(tmp_path / "evil")
    with pytest.raises(ModelLoadError, match="contains custom code"):
        load_model(folder, device="cpu")
    assert not asked and not (folder / "RAN").exists()


def test_every_loader_is_told_not_to_trust_remote_code(tmp_path, monkeypatch):
    seen = []
    for loader in (model_mod.AutoConfig, model_mod.AutoTokenizer, model_mod.AutoModelForCausalLM):
        original = loader.from_pretrained

        def spy(*args, _original=original, _name=loader.__name__, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "unset")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(loader, "from_pretrained", spy)
    load_model(save_tiny_chat(tmp_path / "model"), device="cpu")
    assert {name for name, _ in seen} == {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert all(trust is False for _, trust in seen), seen


# ---------------------------------------------------------------------------------------------
# No pickle: weights from .safetensors (or .gguf), sessions as JSON


def test_pickled_weights_are_refused_unread(tmp_path, monkeypatch):
    folder = save_tiny_chat(tmp_path / "model")
    state = make_tiny_chat()[0].state_dict()
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    with pytest.raises(ModelLoadError, match="only pickled weights"):
        load_model(folder, device="cpu")


UNPICKLERS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("numpy", "load"), ("np", "load")}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}
UNSAFE_KEYWORDS = {("weights_only", False), ("allow_pickle", True)}


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix() for p in
                                        [*REPO.glob("h2o_chat/**/*.py"), REPO / "app.py"]))
def test_the_code_never_unpickles(path):
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & PICKLE_MODULES, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in PICKLE_MODULES, ast.unparse(node)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in UNPICKLERS, ast.unparse(node)
        elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant):
            assert (node.arg, node.value.value) not in UNSAFE_KEYWORDS, ast.unparse(node)


def test_sessions_are_json_and_a_pickle_is_never_read(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    session = ChatSession(model, tok, temperature=0, max_new_tokens=4, data_dir=tmp_path)
    "".join(session.send("hello"))
    record = json.loads((tmp_path / f"{session.id}.json").read_text(encoding="utf-8"))  # plain UTF-8 JSON
    assert record["messages"][0]["content"] == "hello"
    (tmp_path / f"{session.id}.json").write_bytes(pickle.dumps(record))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    with pytest.raises(store.SessionFileError, match="is corrupt"):
        ChatSession.restore(model, tok, session.id, tmp_path)
