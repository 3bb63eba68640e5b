"""Knowledge retrieval as a tool: the Gym's retrieve_knowledge searches the run's Retriever actors."""
from __future__ import annotations

from actors.tools.base import BaseTool, QueryArgs, ToolCall, ToolResult, register_tool


@register_tool
class RetrieveKnowledge(BaseTool):
    """Knowledge-base search through a Retriever actor (or a ShardedRetriever) handle held for the tool's life."""
    name = "retrieve_knowledge"
    description = "Search the medical knowledge base; returns the best matching passages."
    Args = QueryArgs

    def __init__(self, retriever, top_k: int = 3):
        self.retriever, self.top_k = retriever, top_k

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Every query of the batch in one search call."""
        import ray

        from actors.retrieval_env import retrieval_text

        queries = [call.args.query for call in calls]
        search = getattr(self.retriever, "search_async", None)
        try:
            hits = ray.get(search(queries, self.top_k) if search else
                           self.retriever.search.remote(queries, self.top_k))
        except Exception as e:  # noqa: BLE001
            return [ToolResult(error=f"retrieval failed ({type(e).__name__})") for _ in calls]
        return [ToolResult(text=f"retrieve_knowledge: {retrieval_text(h[:self.top_k], None)}",
                           measurements={"hits": float(len(h))}) for h in hits]
