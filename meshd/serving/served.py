"""The supernode's parts of the served model that do not split over stages: the tokenizer
(with this peer's chat template), the KV admission budget (following each plan), and the
draft model. The leader calls ``use`` when this peer leads a plan of a model; the rest
follows from there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
import torch

from meshd.config import Config
from meshd.control.mesh import MeshView
from meshd.control.store import STAGE_KV_SHARE, model_path
from meshd.errors import ModelError
from meshd.serving.drafter import DraftModel
from meshd.serving.pipeline import ActivePlan, Pipeline
from meshd.serving.scheduler import Scheduler, kv_bytes_per_token
from protocol.messages import NO_CHAT
from shards import template_sandbox
from shards.chat_templates import GivenTemplate
from shards.manifest import Manifest
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

KV_SHARE = 0.25  # of a peer's memory budget, for KV caches when no budget is configured


class ServedModel:
    def __init__(self, config: Config, view: MeshView, scheduler: Scheduler, pipeline: Pipeline,
                 chat_template: GivenTemplate | None, spawn: Callable):
        self.config, self.view, self.scheduler, self.pipeline = config, view, scheduler, pipeline
        self.chat_template = chat_template  # used only while this peer is the supernode
        self._spawn = spawn
        self._drafter_for: str | None = None  # the manifest digest --draft-model was last loaded against
        self._budget_model: Manifest | None = None  # the served model the KV budget is for
        pipeline.plan_listeners.append(self._plan_budget)

    def use(self, model_dir, manifest: Manifest) -> str:
        """This peer leads a plan of ``manifest``: the tokenizer (once), the KV budget, the
        draft model (loaded off the loop). Gives the template's origin for the plan
        (``NO_CHAT``: none)."""
        if self.scheduler.tokenizer is None:
            self.scheduler.tokenizer = MeshTokenizer.load(model_dir, self.chat_template)
            if self.scheduler.tokenizer.template.available:
                template_sandbox.pool().warm()  # the render workers start now, not at the first chat
        self._budget_model = manifest
        self.scheduler.kv_budget_tokens = self.kv_budget(manifest)
        if self.config.draft_model and self._drafter_for != (digest := manifest.digest):
            self._drafter_for = digest  # (another served model than the draft model was checked against)
            self.scheduler.drop_drafter()
            self._spawn(self._load_drafter(manifest, digest))
        return self.scheduler.tokenizer.template.origin or NO_CHAT

    def kv_budget(self, manifest: Manifest) -> int:
        """KV positions the scheduler admits: the configured budget, else the least that any
        stage of the active plan holds in KV_SHARE of its peer's memory, a position costing
        its span's layers' KV (and on this peer, once one is loaded, the draft model's: its
        caches, one per session drafting, sit here too); before a plan, this peer holding
        the whole model. A configured budget is held to what those stages' own limits let them
        hold (``store.STAGE_KV_SHARE``): past it they would refuse the steps (KV_FULL)."""
        config = manifest.config
        per_layer = kv_bytes_per_token(config, torch.float32) // max(1, config.n_layers)
        drafter = self.scheduler.drafter
        draft = kv_bytes_per_token(drafter.engine.manifest.config, torch.float32) if drafter is not None else 0
        plan = self.pipeline.plan
        stages = []  # (a stage's peer's caps, its KV bytes a position)
        for a in plan.assignments if plan is not None else ():
            here = a.node == self.view.node_id
            link = None if here else self.view.links.get(a.node)
            caps = self.view.caps if here else link.caps if link is not None else None
            per_token = len(a.span) * per_layer + (draft if here else 0)
            if caps is not None and per_token > 0:
                stages.append((caps, per_token))
        if not stages:  # before a plan, or one whose peers this one no longer links to (the next has the say)
            stages = [(self.view.caps, config.n_layers * per_layer + draft)]  # this peer holding every layer
        configured = self.config.kv_budget_tokens
        if configured is None:
            return max(config.max_position, min(int(caps.mem_budget * KV_SHARE) // n for caps, n in stages))
        held = max(config.max_position, min(int(caps.mem_budget * STAGE_KV_SHARE) // n for caps, n in stages))
        if configured > held:
            log.warning("kv_budget_capped", configured=configured, stages_hold=held,
                        reason="the plan's stages hold no more than this in their share of memory")
            return held
        return configured

    def _plan_budget(self, plan: ActivePlan | None) -> None:
        """A new plan spreads the layers, and their KV, over other peers: the budget follows."""
        if plan is not None and self._budget_model is not None and self.view.is_supernode:
            self.scheduler.kv_budget_tokens = self.kv_budget(self._budget_model)

    async def _load_drafter(self, target: Manifest, digest: str) -> None:
        """The draft model, loaded once this peer serves a model (off the loop), checked
        against it; without it (missing, another tokenizer), speculation goes on with prompt
        lookup alone."""
        name = self.config.draft_model
        assert name is not None
        try:
            drafter = await asyncio.to_thread(DraftModel.load, model_path(self.config, name), target,
                                              self.config.device, self.config.dtype)
        except (ModelError, OSError, ValueError) as exc:
            log.warning("draft_model_unavailable", model=name, error=str(exc))
            return
        if self._drafter_for != digest:  # the served model changed while it loaded
            await asyncio.to_thread(drafter.close)
            return
        self.scheduler.drafter = drafter
        self.scheduler.kv_budget_tokens = self.kv_budget(target)
        log.info("draft_model_loaded", model=drafter.name, layers=drafter.engine.manifest.n_layers,
                 kv_budget_tokens=self.scheduler.kv_budget_tokens)
