"""The grammar of a multi-turn episode: which tags the policy and the environment write (`rollout.grammar`)."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Grammar(BaseModel):
    """Which tags the policy and the environment write (configuration, not code paths): `rollout.grammar`.

    Med-RwR: query/retrieve; Med-R3: search/document; Search-R1: search/information; single turn: action_tag null.
    """
    model_config = ConfigDict(extra="forbid")

    answer_tag: str = "answer"
    action_tag: str | None = Field(None, description="the policy asks the environment with <tag>...</tag>")
    observation_tag: str = Field("retrieve", description="the environment answers inside <tag>...</tag>")
    max_turns: int = Field(4, ge=0, description="environment calls per episode")
    max_response_tokens: int = Field(512, ge=1, description="policy + environment tokens after the prompt")
    max_observation_tokens: int = Field(256, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _top_k_moved(cls, data):
        if isinstance(data, dict) and "top_k" in data:
            raise ValueError("top_k is not a grammar key: documents per query are the retriever's one setting, "
                             "retrieval.search.top_k (agent.retrieval.top_k when serving); move it there")
        return data

    @property
    def action_close(self) -> str | None:
        return f"</{self.action_tag}>" if self.action_tag else None

    def stops(self) -> list[str]:
        return [f"</{self.answer_tag}>"] + ([self.action_close] if self.action_tag else [])

    def action_text(self, segment: str) -> str:
        """The content of the last <action_tag> block the policy just closed."""
        found = re.findall(rf"<{self.action_tag}>(.*?)</{self.action_tag}>", segment, flags=re.S)
        return found[-1].strip() if found else ""

    def wrap_observation(self, body: str) -> str:
        return f"\n<{self.observation_tag}>\n{body}\n</{self.observation_tag}>\n"
