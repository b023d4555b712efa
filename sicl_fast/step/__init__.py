"""One ascent step in torch, the reference every fast form is tested against: proxy, noise, estimator, stop rule."""
