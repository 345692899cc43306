"""L4 tools: the memory tools (batch-size finder, memory stats); layers import only downward."""
