"""The fleet: warmboot replicas on Ray Serve that scale from zero, each restoring from the
shared snapshot store.

``config`` (the shape of ``ray.serve.llm``'s ``LLMConfig``), ``node_cache`` (a per-node,
content-addressed cache in front of a remote store), ``replica`` (one engine behind warmboot's
own HTTP app), ``ingress`` (the OpenAI-compatible front: forwarding, a bounded queue,
fleet-wide ``/health`` and ``/metrics``), ``app`` (build the Serve application, start Ray on
loopback or join a cluster). Importing this package imports neither Ray nor torch.
"""
