"""`speculative serve --replicas N`: N engines behind Ray Serve's HTTP proxy, on one machine.

Each replica is a Ray Serve replica (an actor, a process of its own) holding what `speculative serve`
holds: its LLM, its Scheduler and the OpenAI-compatible app, built in the replica from the parsed flags
(ServerArgs, EngineArgs). Ray's proxy listens on --host/--port and routes each request to a replica (the
one with fewer requests of two picked at random); every response names the one that answered in its
`x-speculative-replica` header. Ray runs the app's lifespan in the replica: it starts the scheduler, and
at the replica's shutdown drains it. A replica that dies is replaced by Ray while the others go on.

Ray starts here as a local instance (never a cluster named by RAY_ADDRESS) with this process's cores,
an equal share per replica; Ray sets each replica's OMP_NUM_THREADS to its share, which torch follows.
The replicas share one /metrics view (metrics.MULTIPROCESS_DIR, a temporary folder).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading

from speculative.engine_args import EngineArgs
from speculative.extras import needs_extra
from speculative.server.args import ServerArgs
from speculative.server.metrics import MULTIPROCESS_DIR, forget_dead_processes

with needs_extra("replicas", "speculative serve --replicas"):
    import ray
    from ray import serve

APP_NAME = "speculative"
"""The Ray Serve application's name (`serve status` shows it)."""
OBJECT_STORE_BYTES = 128 << 20
"""Ray's object store: the replicas pass it nothing, so the least it takes is enough."""


@serve.deployment
@serve.ingress()
class Replica:
    """One engine: `speculative serve`'s app for its flags (`server`, `engine`)."""

    def __init__(self, server: ServerArgs, engine: EngineArgs) -> None:
        self.server, self.engine = server, engine
        forget_dead_processes(os.environ[MULTIPROCESS_DIR])  # the replica this one replaces, if any

    def __serve_build_asgi_app__(self):
        from speculative.console import quiet_transformers
        from speculative.server.app import serve_app

        quiet_transformers()
        return serve_app(self.server, self.engine, replica=serve.get_replica_context().replica_tag)


def serve_replicas(server: ServerArgs, engine: EngineArgs) -> int:
    """Run server.replicas replicas of `speculative serve`'s app behind Ray Serve's proxy on
    --host/--port until SIGINT or SIGTERM, then shut Ray Serve down (each replica gets
    --shutdown-timeout seconds for its running requests) and Ray with it (flags checked by
    `speculative.server.args.check_serve_flags`). OSError when the replicas cannot start (a model
    that does not load), after Ray's tries."""
    share = max(1, len(os.sched_getaffinity(0)) // server.replicas)
    metrics_dir = tempfile.TemporaryDirectory(prefix="speculative-metrics-")
    ray.init(
        address="local",
        num_cpus=share * server.replicas,
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own for SIGTERM
        signal.signal(sig, signal.default_int_handler)
    try:
        serve.start(
            http_options={
                "host": server.host,
                "port": server.port,
                "keep_alive_timeout_s": server.timeout_keep_alive,
            }
        )
        replicas = Replica.options(
            num_replicas=server.replicas,
            ray_actor_options={
                "num_cpus": share,
                "runtime_env": {"env_vars": {MULTIPROCESS_DIR: metrics_dir.name}},
            },
            # room for one request more than a full replica takes, which gets its 429: Ray routes to
            # replicas with room first, and holds requests back only while each is answering a 429
            max_ongoing_requests=server.max_num_seqs + server.max_waiting + 1,
            graceful_shutdown_timeout_s=server.shutdown_timeout,
        )
        try:
            serve.run(replicas.bind(server, engine), name=APP_NAME, route_prefix="/")
        except RuntimeError as error:  # Ray has logged the replicas' own errors
            raise OSError(f"the replicas did not start, see their errors above ({error})") from None
        print(
            f"speculative: {server.replicas} replicas serving on http://{server.host}:{server.port}",
            file=sys.stderr,
            flush=True,
        )
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
        metrics_dir.cleanup()
    return 0
