"""Analyses of exported graphs: facts the runtime needs about a graph, derived once per graph.

Unlike the passes, an analysis never changes the graph; it reads it and returns a verdict.
"""
