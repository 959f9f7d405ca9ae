"""The rollout service's HTTP client (rollout workers post, the trainer samples); ``httpx`` is
imported when a client is built."""

from __future__ import annotations

import math
import time
from typing import Any

from ...errors import RolloutServiceError, ServiceClosedError


class RolloutClient:
    """Talks to a rollout service (rollout workers post, the trainer samples).

    Args:
        url: the service's root URL.
        token: the shared token (``None`` for an open service).
        timeout_s: seconds per HTTP request.

    Example:
        >>> client = RolloutClient("http://10.0.0.5:8088", token=os.environ["BUFFER_TOKEN"])
        >>> client.post_episodes([{"prompt": [1, 2], "completion": [3], "logprobs": [-0.1],
        ...                        "reward": 1.0, "policy_version": 4}])
        >>> batch = client.sample(64, trainer_version=5, wait_s=10)   # None while too few are fresh
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def _post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        import httpx

        try:
            r = self._http.post(path, json=body, **({"timeout": timeout} if timeout else {}))
        except httpx.HTTPError as e:
            raise RolloutServiceError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        return r

    @staticmethod
    def _fail(r) -> None:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        cls = ServiceClosedError if r.status_code == 410 else RolloutServiceError
        raise cls(f"{r.request.method} {r.request.url.path} -> HTTP {r.status_code}: {detail}")

    def post_episodes(self, episodes: list[dict[str, Any]], *, max_wait_s: float = 600.0) -> dict[str, Any]:
        """Post a batch; on 429 wait ``Retry-After`` and post it again, up to ``max_wait_s`` seconds.

        Returns:
            :class:`AddResult` as a dict (``accepted``, ``stored``, ``dropped_stale``, ...).

        Raises:
            ValueError: a float that JSON cannot carry (NaN, infinity), naming the episode and field
                (nothing is posted).
            ServiceClosedError: the trainer closed the service (stop producing).
            RolloutServiceError: refused (invalid: the message says why), unreachable, or still
                full after ``max_wait_s``.
        """
        deadline = time.monotonic() + max_wait_s
        _check_finite(episodes)
        while True:
            r = self._post("/episodes", {"episodes": episodes})
            if r.status_code == 200:
                return r.json()
            if r.status_code == 429:
                try:
                    wait = float(r.json()["retry_after_s"])
                except (ValueError, KeyError, TypeError):
                    wait = float(r.headers.get("retry-after", "1"))
                wait = min(max(wait, 0.0), 60.0)
                if time.monotonic() + wait <= deadline:
                    time.sleep(wait)
                    continue
            self._fail(r)

    def sample(self, batch_size: int, *, trainer_version: int | None = None, wait_s: float = 0.0) -> list[dict] | None:
        """``batch_size`` fresh episodes (oldest policy first, each handed out once), or ``None`` if
        fewer were fresh within ``wait_s`` seconds. Each has ``lag`` (versions behind the trainer)."""
        body: dict[str, Any] = {"batch_size": batch_size, "wait_s": wait_s}
        if trainer_version is not None:
            body["trainer_version"] = trainer_version
        r = self._post("/sample", body, timeout=wait_s + 60.0)
        if r.status_code != 200:
            self._fail(r)
        eps = r.json()["episodes"]
        return eps or None

    def set_version(self, version: int) -> int:
        """Tell the service the trainer's version (episodes more than ``max_lag`` behind are dropped)."""
        r = self._post("/version", {"version": version})
        if r.status_code != 200:
            self._fail(r)
        return r.json()["trainer_version"]

    def close_service(self) -> None:
        """Refuse further episodes (workers get :class:`ServiceClosedError`)."""
        r = self._post("/close", {})
        if r.status_code != 200:
            self._fail(r)

    def stats(self) -> dict[str, Any]:
        """``GET /stats``."""
        import httpx

        try:
            r = self._http.get("/stats")
        except httpx.HTTPError as e:
            raise RolloutServiceError(f"{self.url}/stats: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            self._fail(r)
        return r.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_finite(episodes: list[dict[str, Any]]) -> None:
    """Refuse NaN and infinite floats (JSON has no such numbers), naming the episode and field."""
    for i, ep in enumerate(episodes):
        for key, value in (ep.items() if isinstance(ep, dict) else ()):
            seq = value if isinstance(value, (list, tuple)) else None
            bad = [(j, v) for j, v in enumerate(seq if seq is not None else [value])
                   if isinstance(v, float) and not math.isfinite(v)]
            if bad:
                where = f"{key!r} is {bad[0][1]}" if seq is None else f"{key!r}[{bad[0][0]}] is {bad[0][1]}"
                raise ValueError(f"post_episodes: episode {i}: {where}; JSON carries finite numbers only "
                                 "(nothing was posted)")
