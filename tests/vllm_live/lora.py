"""Live check of ``VLLMAdapterLoader``: LoRA adapter versions hot-swapped into a running vLLM engine
(CPU build), through the offline ``LLM``, an ``AsyncLLM`` or ``vllm serve``'s ``/v1/load_lora_adapter``
routes.

The engine side of a conversation with ``tests/integration/test_vllm_live.py``, whose trainer (in
``.venv``: PEFT is not part of vLLM's environment, nor needed here) publishes the versions. This
script saves the base model (a tiny Qwen3) to ``WORKDIR/base``, starts the engine with LoRA enabled,
prints ``{"step": "ready"}`` and then answers one line per command on stdin:

* ``publish V``: the trainer published version ``V`` and saved its own PEFT checkpoint of it in
  ``WORKDIR/oracle-vV``. The loader takes the newest version from the store (``WORKDIR/store``);
  completions (greedy tokens and top-20 log-probs, exact float bits) through the loaded adapter are
  compared with completions through the trainer's checkpoint, loaded into the same engine under
  another name and then unloaded again.
* ``corrupt V``: version ``V`` was published and one of its objects damaged; the loader's poll must
  fail and the engine keep serving what it served.
* ``refused PREFIX``: another run, under ``PREFIX``, holds an adapter the engine refuses (a rank above
  its ``max_lora_rank``, or one made for another base model); that run's own loader (made on the
  first ``refused`` of the prefix, ids from 500) must fail its poll with the engine's reason, every
  time it is asked, and the engine keep serving the first loader's version.
* ``done``: exit.

Each answer reports what the engine holds (its LoRA ids or served model names) and the loader's
cache folders. Usage: ``lora.py WORKDIR offline|async|server``.
"""

import asyncio
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository root: recipes
from common import PROMPTS, completion, engine, outputs, save, tiny_qwen3  # noqa: E402

RANK = 8


def say(obj) -> None:
    sys.stdout.flush()
    print(json.dumps(obj), flush=True)


class Offline:
    """An offline ``vllm.LLM`` with LoRA enabled."""

    def __init__(self, base: str, work: Path) -> None:
        from torch_deltasync.integrations.vllm import llm_lora_ops

        self.llm = engine(base, backend=False, enable_lora=True, max_lora_rank=RANK, max_loras=3)
        self.ops = llm_lora_ops(self.llm)

    def outputs(self, lora=None):
        return outputs(self.llm, lora_request=lora)

    def through(self, loader):
        return self.outputs(loader.lora_request())

    def through_folder(self, name: str, path: str, lora_id: int):
        from vllm.lora.request import LoRARequest

        try:
            return self.outputs(LoRARequest(name, lora_id, path))
        finally:
            self.remove(lora_id)

    def remove(self, lora_id: int) -> None:
        self.llm.llm_engine.remove_lora(lora_id)

    def held(self):
        return sorted(self.llm.llm_engine.list_loras())

    def wait(self, loader):
        return loader.wait(timeout_s=120, poll_s=0.1)

    def poll(self, loader):
        return loader.poll()

    def stop(self) -> None:
        pass


class Async(Offline):
    """An ``AsyncLLM`` with LoRA enabled, on an event loop of its own thread; the loader is driven
    with ``apoll`` there (``async_llm_lora_ops``)."""

    def __init__(self, base: str, work: Path) -> None:
        from torch_deltasync.integrations.vllm import async_llm_lora_ops

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.llm = self.run(self._start(base))
        self.ops = async_llm_lora_ops(self.llm)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start(self, base: str):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=base, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
            enable_lora=True, max_lora_rank=RANK, max_loras=3))

    async def _generate(self, lora):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20, detokenize=False)

        async def one(i):
            async for out in self.llm.generate({"prompt_token_ids": PROMPTS[i]}, sp, request_id=f"r{id(sp)}-{i}",
                                               lora_request=lora):
                last = out
            return completion(last.outputs[0])

        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))

    def outputs(self, lora=None):
        return self.run(self._generate(lora))

    def remove(self, lora_id: int) -> None:
        self.run(self.llm.remove_lora(lora_id))

    def held(self):
        return sorted(self.run(self.llm.list_loras()))

    def wait(self, loader):
        async def until_loaded():
            while (got := await loader.apoll()) is None:
                await asyncio.sleep(0.1)
            return got

        return self.run(asyncio.wait_for(until_loaded(), 120))

    def poll(self, loader):
        return self.run(loader.apoll())

    def stop(self) -> None:
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)


class Server:
    """``vllm serve`` with ``--enable-lora`` and the runtime LoRA routes (the GRPO recipe's supervised
    server, raw log-probs as the offline engine returns them)."""

    def __init__(self, base: str, work: Path) -> None:
        from recipes.grpo.vllm_server import VLLMServer
        from torch_deltasync.integrations.vllm import server_lora_ops

        self.server = VLLMServer(base, work / "server.log", python=sys.executable, max_model_len=256,
                                 start_timeout_s=300, logprobs_mode="raw_logprobs", deltasync=False,
                                 env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                                 extra_args=["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "3"])
        self.ops = server_lora_ops(self.server.url)

    def outputs(self, model: str = "policy"):
        out = self.server.complete(PROMPTS, max_tokens=8, temperature=0.0, logprobs=20, top_logprobs=True, model=model)
        return [{"tokens": c["tokens"], "logprobs": c["top"]} for c in out]

    def through(self, loader):
        return self.outputs(loader.current.lora_name)

    def through_folder(self, name: str, path: str, lora_id: int):
        self.ops["load"](name, lora_id, path)
        try:
            return self.outputs(name)
        finally:
            self.ops["unload"](name, lora_id)

    def held(self):
        return sorted(m["id"] for m in self.server.get("/v1/models")["data"] if m["id"] != "policy")

    def wait(self, loader):
        return loader.wait(timeout_s=120, poll_s=0.1)

    def poll(self, loader):
        return loader.poll()

    def stop(self) -> None:
        self.server.stop()


def main() -> None:
    work, kind = Path(sys.argv[1]), sys.argv[2]
    from torch_deltasync.integrations.vllm import VLLMAdapterLoader

    base = save(tiny_qwen3(), work / "base")
    eng = {"offline": Offline, "async": Async, "server": Server}[kind](base, work)
    try:
        base_out = eng.outputs()
        loader = VLLMAdapterLoader(eng.ops, str(work / "store"), cache_dir=work / "cache", keep=2)
        say({"step": "ready"})
        previous, others = None, {}
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "done":
                break
            res = {"step": cmd, "arg": arg}
            if cmd == "publish":
                got = eng.wait(loader)
                mine = eng.through(loader)
                oracle = eng.through_folder(f"oracle-v{arg}", str(work / f"oracle-v{arg}"), 1000 + int(arg))
                res.update(version=got.version, lora_name=got.lora_name, lora_int_id=got.lora_int_id,
                           load_ms=got.load_ms, equal=mine == oracle, differs_from_base=mine != base_out,
                           differs_from_previous=previous is not None and mine != previous)
                previous = mine
            elif cmd == "corrupt":
                try:
                    eng.poll(loader)
                    res["error"] = None
                except Exception as e:  # noqa: BLE001
                    res["error"] = f"{type(e).__name__}: {e}"[:2000]
                res.update(version=loader.current.version, unchanged=eng.through(loader) == previous)
            elif cmd == "refused":
                if arg not in others:
                    others[arg] = VLLMAdapterLoader(eng.ops, str(work / "store"), prefix=arg, cache_dir=work / "cache",
                                                    name=arg, id_offset=500 + 100 * len(others))
                other = others[arg]
                try:
                    eng.poll(other)
                    res["error"] = None
                except Exception as e:  # noqa: BLE001
                    res["error"] = f"{type(e).__name__}: {e}"[:2000]
                res.update(other_loaded=[a.lora_name for a in other.loaded], version=loader.current.version,
                           unchanged=eng.through(loader) == previous)
            res.update(held=eng.held(), loaded=[a.lora_name for a in loader.loaded],
                       loaded_ids=[a.lora_int_id for a in loader.loaded],
                       cache=sorted(p.name for p in (work / "cache").iterdir()))
            say(res)
        for other in [loader, *others.values()]:
            other.close()
    finally:
        eng.stop()
    say({"step": "done"})


if __name__ == "__main__":
    main()
