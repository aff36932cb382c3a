"""Chat prompts for the offline benchmark: the workload of issue 13's measurements.

64 user questions, each rendered with the model's chat template (its default system prompt
included) and tokenized, ≈ 45-60 tokens apiece on the default model. Unlike random token ids,
the prompts share their template's opening, as real chat traffic does: an engine with a prefix
cache reuses its full blocks once one request has computed them (vLLM does the same).
"""

from __future__ import annotations

from pathlib import Path

QUESTIONS = (
    (
        "Explain in a few sentences why the sky looks blue during the day but red at sunset. "
        "Please keep the answer short and clear."
    ),
    (
        "What are the main differences between a virus and a bacterium, and how are they "
        "treated? My friend and I disagree about this, so please settle it for us."
    ),
    "Write a short poem about a lighthouse keeper who waits for a ship that never comes.",
    (
        "How does a refrigerator keep food cold? Describe the cycle of the refrigerant "
        "simply. I am asking for a school project, so please use simple words."
    ),
    "Give me three tips for staying focused while studying for an exam at home.",
    (
        "What caused the fall of the Western Roman Empire? Summarise the main theories "
        "briefly. Thank you in advance for your help with this question."
    ),
    "Describe how photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    (
        "I have eggs, spinach, cheese and bread. Suggest a quick breakfast I could make with "
        "them. I would like to understand the idea, not just memorise it."
    ),
    "What is the difference between weather and climate? Give an example of each one.",
    (
        "Explain what a black hole is to a ten-year-old who loves space and rockets. My "
        "friend and I disagree about this, so please settle it for us."
    ),
    "Why do cats purr, and does purring always mean that a cat is happy and relaxed?",
    (
        "List some good habits for keeping a small vegetable garden healthy through the "
        "summer. I am asking for a school project, so please use simple words."
    ),
    "How do vaccines train the immune system to recognise a disease it has never met?",
    (
        "Write a friendly email to a neighbour asking them to water my plants next week. "
        "Thank you in advance for your help with this question."
    ),
    (
        "What is the Pythagorean theorem, and how can I use it to find a missing side length? "
        "A short answer is fine, but include one concrete example."
    ),
    (
        "Why is it important to get enough sleep, and what happens to the brain while we "
        "sleep? I would like to understand the idea, not just memorise it."
    ),
    "Describe the water cycle, from the ocean to the clouds and back down to the rivers.",
    (
        "What should I pack for a three-day hiking trip in the mountains in early autumn? My "
        "friend and I disagree about this, so please settle it for us."
    ),
    "Explain the difference between renewable and non-renewable energy with examples.",
    (
        "How do bees make honey, and why are bees so important for growing our food? I am "
        "asking for a school project, so please use simple words."
    ),
    "Tell me a short story about a robot who learns to paint pictures of the sea.",
    (
        "What are some simple ways to reduce the amount of plastic I throw away each week? "
        "Thank you in advance for your help with this question."
    ),
    "How does the internet send a message from my computer to a server on another continent?",
    (
        "Why do leaves change colour in the autumn before they fall from the trees? I would "
        "like to understand the idea, not just memorise it."
    ),
    "Give me a simple recipe for tomato soup that takes less than thirty minutes to cook.",
    (
        "What is inflation, and why do the prices of everyday goods tend to rise over time? "
        "My friend and I disagree about this, so please settle it for us."
    ),
    "Explain how a bicycle stays upright when it is moving but falls over when it stops.",
    (
        "What were the most important inventions of the Industrial Revolution, and why? I am "
        "asking for a school project, so please use simple words."
    ),
    (
        "How can I politely say no when a colleague asks me to take on extra work again? "
        "Answer in two or three short paragraphs, please."
    ),
    (
        "Describe the life cycle of a butterfly, from the egg to the adult with its wings. "
        "Thank you in advance for your help with this question."
    ),
    "Why does the moon have phases, and how long does it take to go from new to full?",
    (
        "What is the best way to learn a new language as an adult with a busy schedule? I "
        "would like to understand the idea, not just memorise it."
    ),
    "Explain what DNA is and how it carries the instructions for building a living thing.",
    (
        "Write a haiku about the first snow of winter falling on a quiet city street. My "
        "friend and I disagree about this, so please settle it for us."
    ),
    "How do earthquakes happen, and why are some parts of the world hit more often?",
    (
        "What are the benefits of regular exercise for both the body and the mind? I am "
        "asking for a school project, so please use simple words."
    ),
    "Compare trains and aeroplanes for a trip of five hundred kilometres. Which is better?",
    (
        "Why do we have seasons on Earth, and why are they reversed in the two hemispheres? "
        "Thank you in advance for your help with this question."
    ),
    "How does a computer store numbers and letters using only zeros and ones?",
    (
        "Suggest a few fun indoor activities for two children on a rainy Saturday afternoon. "
        "I would like to understand the idea, not just memorise it."
    ),
    "What is the role of the heart in the body, and how does blood travel around it?",
    (
        "Explain the rules of chess for a beginner, starting with how each piece moves. My "
        "friend and I disagree about this, so please settle it for us."
    ),
    (
        "What makes a good password, and why should I use a different one for each website? "
        "Keep it friendly, and avoid any technical jargon if you can."
    ),
    (
        "Describe the taste and texture of a ripe mango to someone who has never eaten one. I "
        "am asking for a school project, so please use simple words."
    ),
    "Why do some materials conduct electricity well while others are good insulators?",
    (
        "How did ancient sailors navigate across the open ocean without any modern tools? "
        "Thank you in advance for your help with this question."
    ),
    "Give me five interesting facts about octopuses and how they hunt for their food.",
    (
        "What is the greenhouse effect, and how do human activities make it stronger? I would "
        "like to understand the idea, not just memorise it."
    ),
    "How should I prepare for a job interview at a small software company next Monday?",
    (
        "Explain why ice floats on water when most solids sink in their own liquids. My "
        "friend and I disagree about this, so please settle it for us."
    ),
    "Write a limerick about a forgetful wizard who keeps losing his magic hat.",
    (
        "What is the difference between a democracy and a monarchy? Give modern examples. I "
        "am asking for a school project, so please use simple words."
    ),
    "How do noise-cancelling headphones remove the sound of an aeroplane engine?",
    (
        "Why is the ocean salty while the water in most rivers and lakes is fresh? Thank you "
        "in advance for your help with this question."
    ),
    "Describe a typical day in the life of a medieval farmer living in a small village.",
    (
        "What are prime numbers, and why are they so useful in modern cryptography? I would "
        "like to understand the idea, not just memorise it."
    ),
    (
        "How can I make my small apartment feel brighter and more spacious on a budget? "
        "Please keep the answer short and clear."
    ),
    (
        "Explain how a rainbow forms and why its colours always appear in the same order. My "
        "friend and I disagree about this, so please settle it for us."
    ),
    "What are the main causes of stress at work, and how can people manage them better?",
    (
        "Why do we yawn, and is it true that yawning is contagious between people? I am "
        "asking for a school project, so please use simple words."
    ),
    "Describe how a bill becomes a law in a parliament with two separate chambers.",
    (
        "What is machine learning? Explain it with an example from everyday life. Thank you "
        "in advance for your help with this question."
    ),
    "How do migrating birds find their way over thousands of kilometres every year?",
    (
        "Give me some advice for running my first ten-kilometre race next spring. I would "
        "like to understand the idea, not just memorise it."
    ),
)


def chat_prompts(model_dir: Path, num: int) -> list[list[int]]:
    """`num` prompts (the questions in order, repeated past 64) as the chat template's ids."""
    from engine.api.model_files import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_dir} has no tokenizer with a chat template for chat prompts")
    prompts = []
    for i in range(num):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts
