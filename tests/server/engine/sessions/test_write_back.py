"""A session held in memory whose record vanished from a `dir:` store (the directory removed and made again)
is written back once the store takes writes, so a restart still continues it exactly."""

from __future__ import annotations

import shutil
import time

from linserve.server.engine.sessions import upkeep

GREEDY = {"prompt": " and", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_a_vanished_record_is_written_back(make_client, tmp_path, monkeypatch):
    monkeypatch.setattr(upkeep, "STORE_SWEEP_INTERVAL_S", 0.2)  # the sweep that notices, sooner
    directory = tmp_path / "store"
    client = make_client(session_store=f"dir:{directory}")
    sid = client.post("/v1/sessions", json={"prompt": "HAMLET.\nTo be"}).json()["id"]
    assert client.post(f"/v1/sessions/{sid}/completions", json=GREEDY).status_code == 200
    snapshot = client.get(f"/v1/sessions/{sid}/state").content
    record = directory / f"{sid}.lsess"
    assert record.exists()
    shutil.rmtree(directory)
    directory.mkdir()
    deadline = time.monotonic() + 30  # a hang's bound
    while not record.exists():
        assert time.monotonic() < deadline, "the vanished record was never written back"
        time.sleep(0.05)
    assert client.get("/v1/sessions").json()["data"][0]["id"] == sid
    client.__exit__(None, None, None)
    again = make_client(session_store=f"dir:{directory}")
    copy = again.post("/v1/sessions/import", content=snapshot).json()["id"]
    texts = [again.post(f"/v1/sessions/{s}/completions", json=GREEDY).json()["choices"][0]["text"] for s in (sid, copy)]
    assert texts[0] == texts[1]
    assert again.get(f"/v1/sessions/{sid}").json()["tokens"] == again.get(f"/v1/sessions/{copy}").json()["tokens"]
