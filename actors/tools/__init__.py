"""Medical image tools for tool-using policies (MedVistaGym's Gym, MedVR's zoom-in): one interface and a registry
(`base`), the image tools that run offline (`image_tools`), the model-backed ones (`model_tools`) and knowledge
retrieval (`knowledge`). Importing the package registers every tool."""
from actors.tools import image_tools, knowledge, model_tools  # noqa: F401  (each registers its tools)
from actors.tools.base import (TOOLS, BaseTool, ToolArgs, ToolArgumentError, ToolCall, ToolContext, ToolResult,
                               make_tool, register_tool, tool_class)
from actors.tools.image_tools import box_iou

__all__ = ["TOOLS", "BaseTool", "ToolArgs", "ToolArgumentError", "ToolCall", "ToolContext", "ToolResult", "box_iou",
           "make_tool", "register_tool", "tool_class"]
