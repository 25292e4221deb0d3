"""A replica-side pool worker in its own process, driven by JSON lines on stdin.

    python -m tests.pool_service.sync_worker URL NAMESPACE ORIGIN
    > {"op": "publish", "tokens": [...]}      < {"ok": true}
    > {"op": "propose", "context": [...], "n": 4}   < {"draft": [...]}
    > {"op": "stats"}                          < {... SharedPools.stats() ...}
    > {"op": "stop"}                           < {"ok": true}
It prints {"ready": true} once started (the retained pool replayed).
"""

from __future__ import annotations

import asyncio
import json
import sys

from pool_service import PoolConfig, SharedPools


async def main(url: str, namespace: str, origin: str) -> None:
    pools = SharedPools(PoolConfig(redis_url=url), namespace, origin=origin, vocab_size=1000)
    await pools.start()
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        if command["op"] == "publish":
            pools.publish(None, command["tokens"])
            reply: dict = {"ok": True}
        elif command["op"] == "propose":
            _, pool_index = pools.sources_for(None)[1]
            reply = {"draft": pool_index.propose(command["context"], command["n"])[0]}
        elif command["op"] == "stats":
            reply = pools.stats()
        else:
            await pools.stop()
            print(json.dumps({"ok": True}), flush=True)
            return
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
