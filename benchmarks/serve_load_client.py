"""The HTTP side of `benchmarks/serve_load.py`: an open-loop client that
sends each request at its arrival time and records what came back.

It runs in its own process (`run_in_child`), so the server's process holds
only the server and the engine, as in deployment.  Requests of a kind other
than "normal" misbehave on purpose: a bad field (400 expected), an unknown
document id (404 expected), a stream the client drops after its first
token, and a non-streaming request the client gives up on after a random
short wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import time

KINDS = ("normal", "bad_field", "unknown_id", "disconnect_stream",
         "disconnect_wait")
EXPECTED_STATUS = {"bad_field": 400, "unknown_id": 404}


def run_in_child(url: str, requests: list[dict], max_connections: int,
                 seed: int) -> dict:
  """`run` in a fresh process; returns what it returns."""
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
    return pool.submit(run, url, requests, max_connections, seed).result()


def run(url: str, requests: list[dict], max_connections: int,
        seed: int) -> dict:
  """Sends `requests` (dicts with "arrival" seconds, "kind", "path",
  "body") open loop; returns {"records": one per request, in order,
  "seconds": from the first send to the last answer}."""
  return asyncio.run(_run(url, requests, max_connections, seed))


async def _run(url, requests, max_connections, seed):
  import httpx
  rng = random.Random(seed)
  limits = httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_connections)
  async with httpx.AsyncClient(base_url=url, limits=limits,
                               timeout=httpx.Timeout(600.0)) as client:
    start = time.perf_counter()
    first_send = None
    tasks = []
    for request in requests:
      delay = start + request["arrival"] - time.perf_counter()
      if delay > 0:
        await asyncio.sleep(delay)
      if first_send is None:  # the wait before it is no serving time
        first_send = time.perf_counter()
      # Short enough that most give up queued or mid-generation.
      give_up_after = rng.uniform(0.0, 0.03)
      tasks.append(asyncio.ensure_future(
          _one(client, request, give_up_after)))
    records = await asyncio.gather(*tasks)
  end = time.perf_counter()
  for record in records:
    record["started_s"] -= start
  return {"records": records,
          "seconds": end - (start if first_send is None else first_send)}


async def _one(client, request, give_up_after: float) -> dict:
  record = {"index": request["index"], "kind": request["kind"],
            "outcome": "", "status": 0, "error_type": None, "tokens": [],
            "ttft_s": None, "latency_s": None, "finish_reason": None,
            "usage": None, "started_s": time.perf_counter()}
  try:
    if request["kind"] == "disconnect_wait":
      await asyncio.wait_for(_call(client, request, record), give_up_after)
    else:
      await _call(client, request, record)
  except (asyncio.TimeoutError, _Dropped):
    record["outcome"] = "disconnected"
  except Exception as error:  # noqa: BLE001 - counted by type
    record["outcome"] = f"client_error:{type(error).__name__}"
  record["latency_s"] = time.perf_counter() - record["started_s"]
  if not record["outcome"]:
    record["outcome"] = "ok" if record["status"] == 200 else (
        f"http_{record['status']}")
  return record


class _Dropped(Exception):
  """The client dropped the stream on purpose."""


async def _call(client, request, record):
  body = request["body"]
  if not body.get("stream"):
    response = await client.post(request["path"], json=body)
    record["status"] = response.status_code
    data = response.json()
    if response.status_code != 200:
      record["error_type"] = data.get("error", {}).get("type")
      return
    record["ttft_s"] = None
    choice = data["choices"][0]
    record["tokens"] = choice.get("token_ids", [])
    record["finish_reason"] = choice["finish_reason"]
    record["usage"] = data["usage"]
    return
  sent = time.perf_counter()
  async with client.stream("POST", request["path"], json=body) as response:
    record["status"] = response.status_code
    if response.status_code != 200:
      data = json.loads(await response.aread())
      record["error_type"] = data.get("error", {}).get("type")
      return
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if "error" in chunk:
        record["error_type"] = chunk["error"]["type"]
        record["status"] = 500
        return
      if chunk.get("usage"):
        record["usage"] = chunk["usage"]
      for choice in chunk["choices"]:
        if choice.get("token_ids"):
          if record["ttft_s"] is None:
            record["ttft_s"] = time.perf_counter() - sent
          record["tokens"] += choice["token_ids"]
          if request["kind"] == "disconnect_stream":
            raise _Dropped()
        if choice.get("finish_reason"):
          record["finish_reason"] = choice["finish_reason"]
