"""Chapter 9 — serving at scale: chapter 8's server at the ingress of a Ray Serve application, engine replicas
behind it, request routers that pick a replica, a per-client rate limit at the gateway.

`python -m minillm serve --replicas N` starts it (`ray_app.serve_on_ray`); `RayService` runs it in the background.
"""
