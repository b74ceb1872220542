"""fastllm run and chat with --json-schema FILE: the reply is JSON that
follows the schema; a bad file is a clear error."""
import io
import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastllm.cli import main as cli  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 30},
                         "country": {"type": "string", "maxLength": 30}}}


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "place.json"
    path.write_text(json.dumps(SCHEMA))
    return path


@pytest.mark.slow
def test_run_and_chat_reply_with_json_that_follows_the_schema(fastllm_home, schema_file, capsys, monkeypatch):
    assert cli.main(["run", "--chat", "--json-schema", str(schema_file), "--temp", "0", "-n", "120",
                     "Where is the Eiffel tower?"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)
    monkeypatch.setattr("sys.stdin", io.StringIO("Where is the Colosseum?\n"))
    assert cli.main(["chat", "--json-schema", str(schema_file), "--temp", "0", "-n", "120"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)


def test_a_bad_schema_file_is_a_clear_error(fastllm_home, tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert cli.main(["run", "--json-schema", str(missing), "hi"]) == 1
    assert f"--json-schema {missing}" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "wrong"}}}')
    assert cli.main(["run", "--json-schema", str(bad), "hi"]) == 1
    assert "Invalid type: wrong" in capsys.readouterr().err
